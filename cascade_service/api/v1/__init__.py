"""Generated from protos/cascade/v1/cascade.proto by `python -m cascade_service.api.codegen`; do not edit."""
