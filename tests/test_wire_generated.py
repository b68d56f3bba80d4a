"""The committed generated code matches proto/fedcore.proto.

fedcore/wire/*_pb2*.py are committed (so installing needs no compiler); this
test compiles the .proto again with grpc_tools and compares the file
descriptors, i.e. the schema itself rather than generator-version text.
"""
from pathlib import Path

from tests.conftest import need_extra

need_extra("dev", "grpc_tools")

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from fedcore.comm.stream import METHOD
from fedcore.wire import fedcore_pb2, fedcore_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _without_json_names(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """protoc's descriptor sets spell out each field's derived json_name; generated code does not."""
    def strip(messages):
        for m in messages:
            for f in m.field:
                f.ClearField("json_name")
            strip(m.nested_type)
    strip(fd.message_type)
    return fd


def test_committed_descriptors_match_the_proto(tmp_path):
    out = tmp_path / "fedcore.pb"
    rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--descriptor_set_out={out}",
                      f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                      str(ROOT / "proto" / "fedcore.proto")])
    assert rc == 0
    fresh = _without_json_names(descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0])
    committed = descriptor_pb2.FileDescriptorProto.FromString(fedcore_pb2.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "regenerate: see docs/deployment_reference.md (generated code)"
    assert (tmp_path / "fedcore_pb2_grpc.py").is_file()


def test_grpc_module_is_package_relative_and_names_the_method_in_use():
    src = Path(fedcore_pb2_grpc.__file__).read_text()
    assert "from fedcore.wire import fedcore_pb2" in src
    service = fedcore_pb2.DESCRIPTOR.services_by_name["Fedcore"]
    method = service.methods_by_name["Connect"]
    assert f"/{service.full_name}/{method.name}" == METHOD
    assert method.client_streaming and method.server_streaming
