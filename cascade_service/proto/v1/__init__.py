"""Generated from protos/cascade/v1/cascade.proto by `python -m cascade_service.proto.codegen`; do not edit."""
