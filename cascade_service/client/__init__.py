"""Python SDK for cascade-service's gRPC API (protos/cascade/v1/cascade.proto).

    from cascade_service.client import CascadeClient, errors
    with CascadeClient("127.0.0.1:9000", api_key=KEY) as client:
        print(client.generate("def f():", max_new_tokens=64).text)

AsyncCascadeClient has the same methods as coroutines (`async for` over stream()). Failures raise
errors.CascadeError subclasses, with the server's rich error details (`field_violations`,
`retry_delay_s`); get_session and health retry UNAVAILABLE (after the server's RetryInfo delay when it
sends one), nothing else retries.
"""

from cascade_service.client import errors
from cascade_service.client.aio import AsyncCascadeClient
from cascade_service.client.sync import CascadeClient, Chunk, GenerateResult, SessionInfo

__all__ = ["AsyncCascadeClient", "CascadeClient", "Chunk", "GenerateResult", "SessionInfo", "errors"]
