"""Generate the gRPC stubs of deviceplugin.proto (run at build time: scripts/setup, and
before building packages). The generated modules are not committed: they come from the
.proto and the grpcio-tools in use, so they always match the installed grpcio."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    from grpc_tools import protoc

    out = os.path.join(HERE, "generated")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "__init__.py"), "w") as f:
        f.write('"""Generated from ../deviceplugin.proto by build_stubs.py; do not edit."""\n')
    code = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}",
                        os.path.join(HERE, "deviceplugin.proto")])
    if code != 0:
        return code
    # grpc_tools writes `import deviceplugin_pb2`; make it package-relative.
    grpc_module = os.path.join(out, "deviceplugin_pb2_grpc.py")
    with open(grpc_module) as f:
        text = f.read()
    with open(grpc_module, "w") as f:
        f.write(text.replace("import deviceplugin_pb2 as", "from . import deviceplugin_pb2 as"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
