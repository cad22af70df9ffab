"""Generated protobuf and gRPC modules of the loraplex v1 API (``*_pb2``, ``*_pb2_grpc``).

Only ``loraplex.server.wire`` imports them; regenerate with::

    python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
        --grpc_python_out=proto proto/loraplex/v1/*.proto
"""
