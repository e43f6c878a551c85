"""How a call to a tier fails, whatever carried it: the edge maps these to gRPC status codes."""


class Unavailable(Exception):
    """A tier could not be reached (replica died, deployment restarting): retryable."""


class Overloaded(Exception):
    """A deployment's bounded queue is full (the wiring raises it): RESOURCE_EXHAUSTED, retry later."""
