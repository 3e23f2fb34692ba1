"""The image's gRPC stubs (deploy/kubernetes/Containerfile), made as its build makes them:
the pinned grpcio-tools generates them, and Debian 12's own python3-grpcio and
python3-protobuf must load them (the image has no others). The image build itself needs a
registry this machine cannot reach; this is the step of it that can break."""

import os
import re
import shutil
import subprocess
import sys

from conftest import REPO, require, require_root_tools

CONTAINERFILE = os.path.join(REPO, "deploy", "kubernetes", "Containerfile")
PROTO_DIR = os.path.join(REPO, "gpuhook", "plugin")
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


def pinned_grpcio_tools() -> str:
    with open(CONTAINERFILE) as f:
        (version,) = re.findall(r"'grpcio-tools==([0-9.]+)'", f.read())
    return version


def test_the_pinned_grpcio_tools_makes_stubs_debians_grpc_and_protobuf_load(tmp_path):
    require_root_tools("dpkg-query")
    debian = "/usr/bin/python3"
    found = subprocess.run([debian, "-I", "-c", "import grpc, google.protobuf as p; print(grpc.__version__, "
                            "p.__version__, grpc.__file__)"], capture_output=True, text=True, env=CLEAN_ENV)
    require(found.returncode == 0 and "/usr/lib/python3/dist-packages/" in found.stdout,
            "needs Debian's python3-grpcio and python3-protobuf (scripts/setup installs them)")
    version = pinned_grpcio_tools()
    tools = tmp_path / "grpcio-tools"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
                           "--target", str(tools), f"grpcio-tools=={version}"], capture_output=True, text=True)
    require(done.returncode == 0, f"needs PyPI for grpcio-tools=={version}: {done.stderr[-300:]}")
    # What build_stubs.py does, with the image's interpreter and packages only.
    package = tmp_path / "pkg" / "gpuhook" / "plugin"
    shutil.copytree(PROTO_DIR, package, ignore=shutil.ignore_patterns("generated", "__pycache__"))
    (package.parent / "__init__.py").write_text("")
    generate = subprocess.run([debian, "-I", "-c", f"import sys; sys.path.append({str(tools)!r}); "
                               f"sys.argv = ['build_stubs']; import runpy; "
                               f"runpy.run_path({str(package / 'build_stubs.py')!r}, run_name='__main__')"],
                              capture_output=True, text=True, env=CLEAN_ENV)
    assert generate.returncode == 0, generate.stdout + generate.stderr
    load = subprocess.run([debian, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "from gpuhook.plugin.generated import deviceplugin_pb2 as pb, deviceplugin_pb2_grpc as rpc; "
                           "d = pb.Device(ID='GPU-1', health='Healthy', topology=pb.TopologyInfo("
                           "nodes=[pb.NUMANode(ID=1)])); print(d.topology.nodes[0].ID, rpc.DevicePluginStub.__name__)",
                           str(tmp_path / "pkg")], capture_output=True, text=True, env=CLEAN_ENV)
    assert load.returncode == 0, load.stderr
    assert load.stdout.split() == ["1", "DevicePluginStub"]
