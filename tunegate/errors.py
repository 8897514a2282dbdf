"""The root of every error tunegate raises, and its two main branches.

    TunegateError
    ├── InputError (also a ValueError): what a user gave is wrong; a CLI exits 2, the sidecar answers 4xx
    │   ├── tunegate: CodecError (a KServe v2 body), GrpcCodecError (a gRPC inference message with no HTTP
    │   │   form), ToleranceError, CaptureError, ConfigTextError (config.pbtxt), ServingError (a serving
    │   │   configuration that cannot apply to a model's config)
    │   ├── tuner: SpecError, RouteError, InputsError
    │   └── sidecar: ConfigError (sidecar.toml), StatsError (Triton's statistics JSON)
    ├── ServiceError (also a RuntimeError): a service, a file or a process failed; a CLI exits 1
    │   ├── tunegate: TritonError ── TritonStartError, RepositoryError, ModelError, DemoError, PerfError (a
    │   │   replayed load request failed)
    │   ├── tuner: BuildError ── BuildTimeout, TuneError, CacheError
    │   ├── loadtest: LoadTestError
    │   └── sidecar: StateError, AdminError (the admin API's answer), ControlError (Triton's repository API or
    │       the repository) ── PromotionError, RollbackFailed
    ├── UpstreamError ── UpstreamTimeout, TritonSilent: a request to Triton got no answer (the client path's
    │   502 and 504; on the mirror, sidecar.faults decides whether it speaks against the candidate or against
    │   Triton: TritonSilent is a copy's timeout while the baseline did not answer either)
    ├── CanaryError, RollbackError: an admin request the sidecar refuses; each carries its HTTP status
    └── CliError: a command's message and exit code (tunegate.console)

`except TunegateError` catches everything tunegate raises on purpose; anything else is a bug.
"""

from __future__ import annotations


class TunegateError(Exception):
    """The root: every error tunegate raises on purpose."""


class InputError(TunegateError, ValueError):
    """Something a user gave (a file, a flag, a request) is wrong; the message says what and where."""


class ServiceError(TunegateError, RuntimeError):
    """A service (Triton, the sidecar), a file or a child process failed; the message says which and why."""
