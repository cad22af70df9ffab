"""The gRPC wire: the only code that touches the generated ``*_pb2`` modules (design.md §3).

``messages`` converts protobuf messages to and from the service's dataclasses, ``services``
serves the loraplex services (and health, reflection) from implementations that speak only
dataclasses, and ``stubs`` holds the client stubs. Below this package nothing sees protobuf.
"""
