"""One exception root: every error class the packages define derives from tunegate.errors.TunegateError."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from tunegate.errors import InputError, ServiceError, TunegateError

PACKAGES = ("tunegate", "tuner", "sidecar", "loadtest")
# Triton-side code (runs inside the python backend, imports triton_python_backend_utils) and Locust's file.
NOT_IMPORTED = ("tunegate.templates", "tunegate.assets", "loadtest.locustfile")
# Control flow inside one module, never raised out of it: the search's spent budget, the client path's refusal
# of a request (answered there with its 4xx).
INTERNAL = {"tuner.search._BudgetSpent", "sidecar.proxy._Reject"}


def error_classes() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."):
            if info.name.startswith(NOT_IMPORTED):
                continue
            mod = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(mod, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == mod.__name__:
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_error_has_the_one_root() -> None:
    classes = error_classes()
    assert len(classes) >= 25, sorted(c.__name__ for c in classes)
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, TunegateError)]
    assert set(strays) == INTERNAL, strays


@pytest.mark.parametrize(
    "cls", [c for c in error_classes() if issubclass(c, InputError)], ids=lambda c: c.__name__
)
def test_input_errors_stay_value_errors(cls: type[BaseException]) -> None:
    assert issubclass(cls, ValueError) and not issubclass(cls, ServiceError)


def test_the_docstring_draws_every_public_error() -> None:
    import tunegate.errors

    doc = tunegate.errors.__doc__ or ""
    missing = [c.__name__ for c in error_classes() if issubclass(c, TunegateError) and c.__name__ not in doc]
    assert not missing, missing
