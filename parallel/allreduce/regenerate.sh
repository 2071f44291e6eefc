#!/usr/bin/env bash
# Regenerates allreduce_pb2.py and allreduce_pb2.pyi, the messages, from
# allreduce.proto; the service's methods are bound by hand in _rpc.py.
#
# The code generator runs in a throwaway virtualenv: grpcio-tools pins its own
# protobuf, and newer releases need protobuf 7, which the project's runtime
# (protobuf>=6.33,<7) must not be upgraded to. grpcio-tools 1.80.0 emits
# protobuf 6.31.1 gencode, whose version check passes for every runtime that
# pyproject.toml allows (protobuf>=6.33).
#
#   parallel/allreduce/regenerate.sh [python3]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${1:-python3}"
tools_venv="$(mktemp -d)"
trap 'rm -rf "${tools_venv}"' EXIT

"${python}" -m venv "${tools_venv}"
"${tools_venv}/bin/pip" install --quiet 'grpcio-tools==1.80.0' 'protobuf>=6.31.1,<7'

cd "${here}"
"${tools_venv}/bin/python" -m grpc_tools.protoc \
  --proto_path=. \
  --python_out=. \
  --pyi_out=. \
  allreduce.proto

echo "regenerated: $(ls allreduce_pb2*)"
