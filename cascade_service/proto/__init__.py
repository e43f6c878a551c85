"""The wire's types: the protobuf stubs generated from `protos/` (`python -m cascade_service.proto.codegen`).

The lowest layer that knows the wire: the edge (api/), the SDK (client/), the tier transport
(transport/) and tier hosting (tierhost/) all import it; it imports nothing of the package.
"""
