"""gpuhook/plugin/deviceplugin.proto is kubelet's device plugin API v1beta1, names included.

The wire carries only field numbers and types, so a field named differently from kubelet's
still works over gRPC; JSON transcoding, reflection and generated code in other languages
see the names. The table below is written from kubelet's api.proto
(kubernetes/staging/src/k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1/api.proto): every message
with its fields (name, number, repeated, type) and every service with its methods."""

import pytest

protoc = pytest.importorskip("grpc_tools.protoc")
from google.protobuf import descriptor_pb2  # noqa: E402  (after the skip: grpc_tools brings protobuf)

from gpuhook.plugin import build_stubs  # noqa: E402

R = "repeated"
KUBELET_MESSAGES = {
    "DevicePluginOptions": [("pre_start_required", 1, "", "bool"),
                            ("get_preferred_allocation_available", 2, "", "bool")],
    "RegisterRequest": [("version", 1, "", "string"), ("endpoint", 2, "", "string"),
                        ("resource_name", 3, "", "string"), ("options", 4, "", ".v1beta1.DevicePluginOptions")],
    "Empty": [],
    "ListAndWatchResponse": [("devices", 1, R, ".v1beta1.Device")],
    "TopologyInfo": [("nodes", 1, R, ".v1beta1.NUMANode")],
    "NUMANode": [("ID", 1, "", "int64")],
    "Device": [("ID", 1, "", "string"), ("health", 2, "", "string"), ("topology", 3, "", ".v1beta1.TopologyInfo")],
    "PreStartContainerRequest": [("devices_ids", 1, R, "string")],
    "PreStartContainerResponse": [],
    "PreferredAllocationRequest": [("container_requests", 1, R, ".v1beta1.ContainerPreferredAllocationRequest")],
    "ContainerPreferredAllocationRequest": [("available_deviceIDs", 1, R, "string"),
                                            ("must_include_deviceIDs", 2, R, "string"),
                                            ("allocation_size", 3, "", "int32")],
    "PreferredAllocationResponse": [("container_responses", 1, R, ".v1beta1.ContainerPreferredAllocationResponse")],
    "ContainerPreferredAllocationResponse": [("deviceIDs", 1, R, "string")],
    "AllocateRequest": [("container_requests", 1, R, ".v1beta1.ContainerAllocateRequest")],
    "ContainerAllocateRequest": [("devices_ids", 1, R, "string")],
    "CDIDevice": [("name", 1, "", "string")],
    "AllocateResponse": [("container_responses", 1, R, ".v1beta1.ContainerAllocateResponse")],
    "ContainerAllocateResponse": [("envs", 1, R, ".v1beta1.ContainerAllocateResponse.EnvsEntry"),
                                  ("mounts", 2, R, ".v1beta1.Mount"), ("devices", 3, R, ".v1beta1.DeviceSpec"),
                                  ("annotations", 4, R, ".v1beta1.ContainerAllocateResponse.AnnotationsEntry"),
                                  ("cdi_devices", 5, R, ".v1beta1.CDIDevice")],
    "Mount": [("container_path", 1, "", "string"), ("host_path", 2, "", "string"), ("read_only", 3, "", "bool")],
    "DeviceSpec": [("container_path", 1, "", "string"), ("host_path", 2, "", "string"),
                   ("permissions", 3, "", "string")],
}
KUBELET_SERVICES = {
    "Registration": [("Register", "RegisterRequest", "Empty", False)],
    "DevicePlugin": [("GetDevicePluginOptions", "Empty", "DevicePluginOptions", False),
                     ("ListAndWatch", "Empty", "ListAndWatchResponse", True),
                     ("GetPreferredAllocation", "PreferredAllocationRequest", "PreferredAllocationResponse", False),
                     ("Allocate", "AllocateRequest", "AllocateResponse", False),
                     ("PreStartContainer", "PreStartContainerRequest", "PreStartContainerResponse", False)],
}
TYPES = {descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: "bool", descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
         "string", descriptor_pb2.FieldDescriptorProto.TYPE_INT64: "int64",
         descriptor_pb2.FieldDescriptorProto.TYPE_INT32: "int32"}


@pytest.fixture(scope="module")
def proto_file(tmp_path_factory):
    """The FileDescriptorProto protoc makes of gpuhook's .proto (no stubs needed)."""
    out = tmp_path_factory.mktemp("proto") / "set.pb"
    source = f"{build_stubs.HERE}/deviceplugin.proto"
    assert protoc.main(["protoc", f"-I{build_stubs.HERE}", f"--descriptor_set_out={out}", source]) == 0
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    return files[0]


def _field(field) -> tuple:
    label = R if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED else ""
    return field.name, field.number, label, field.type_name or TYPES[field.type]


def test_every_message_has_kubelets_field_names_numbers_and_types(proto_file):
    assert proto_file.package == "v1beta1"
    assert {m.name: [_field(f) for f in m.field] for m in proto_file.message_type} == KUBELET_MESSAGES


def test_the_services_are_kubelets(proto_file):
    assert {s.name: [(m.name, m.input_type.rpartition(".")[2], m.output_type.rpartition(".")[2],
                      m.server_streaming) for m in s.method] for s in proto_file.service} == KUBELET_SERVICES


def test_the_go_package_option_is_kubelets(proto_file):
    assert proto_file.options.go_package == "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"


def test_json_transcoding_names_the_device_ids_as_kubelet_does(proto_file):
    # protoc's lowerCamelCase of kubelet's devices_ids; gpuhook's devicesIDs gave "devicesIDs".
    for name in ("PreStartContainerRequest", "ContainerAllocateRequest"):
        (message,) = [m for m in proto_file.message_type if m.name == name]
        assert [f.json_name for f in message.field] == ["devicesIds"]
