"""`parallel.allreduce.__all__` names exist, import, and the stubs match the proto."""

import pathlib

from google.protobuf.descriptor import FieldDescriptor

import embedding
from parallel import allreduce
from parallel.allreduce import allreduce_pb2


def test_every_public_name_imports():
    assert len(set(allreduce.__all__)) == len(allreduce.__all__)
    namespace = {}
    exec("from parallel.allreduce import *", namespace)  # noqa: S102 - the star import itself
    assert set(allreduce.__all__) <= set(namespace)


def test_the_committed_stubs_match_the_proto():
    proto = pathlib.Path(allreduce.__file__).with_name("allreduce.proto").read_text()
    message = allreduce_pb2.AllReduceData.DESCRIPTOR
    fields = {field.name: (field.number, field.type) for field in message.fields}
    assert fields == {
        "sync_key": (1, FieldDescriptor.TYPE_UINT64),
        "src_rank": (2, FieldDescriptor.TYPE_UINT32),
        "bool_val": (3, FieldDescriptor.TYPE_BOOL),
        "uint64_val": (4, FieldDescriptor.TYPE_UINT64),
        "mac": (5, FieldDescriptor.TYPE_BYTES),
    }
    assert [f.name for f in message.oneofs_by_name["value"].fields] == ["bool_val", "uint64_val"]
    service = allreduce_pb2.DESCRIPTOR.services_by_name["AllReduce"]
    assert service.full_name == "sparseflow.allreduce.AllReduce"
    method = service.methods_by_name["ContributeData"]
    assert method.output_type.full_name == "google.protobuf.Empty"
    declarations = ("uint64 sync_key = 1;", "uint32 src_rank = 2;", "bytes mac = 5;")
    for declaration in (*declarations, "rpc ContributeData("):
        assert declaration in proto


def test_one_all_reduce_interface_serves_embedding_and_parallel():
    assert allreduce.AllReduceInterface is embedding.AllReduceInterface
