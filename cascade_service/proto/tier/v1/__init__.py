"""Generated from protos/cascade/tier/v1/tier.proto by `python -m cascade_service.proto.codegen`; do not edit."""
