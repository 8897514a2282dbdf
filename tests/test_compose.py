"""The compose stack, validated without a Docker engine: `docker compose config` where the plugin exists,
else (and also) structural checks: every image pinned, every mounted path exists, ports consistent with the
Prometheus, Grafana, sidecar and Locust configs, the Triton image matching the embedded server."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.prometheus_support import COMPOSE, PROM_DIR, ROOT, load_yaml

COMPOSE_FILE = COMPOSE / "docker-compose.yml"
GPU_FILE = COMPOSE / "docker-compose.gpu.yml"
DOCKERFILE = COMPOSE / "sidecar" / "Dockerfile"
# Values the `${VAR:?}` variables need for `docker compose config`.
SERVICES = {"triton", "sidecar", "prometheus", "grafana", "locust-master", "locust-worker"}
REQUIRED_ENV = {"TUNEGATE_ADMIN_TOKEN": "test-token", "GRAFANA_ADMIN_PASSWORD": "test-password"}


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    data: dict[str, Any] = load_yaml(COMPOSE_FILE)
    return data


def services(stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = stack["services"]
    return result


def flag(svc: dict[str, Any], name: str) -> str:
    """The value of `--name=VALUE` in a service's command."""
    for arg in svc.get("command", []):
        if str(arg).startswith(f"--{name}="):
            return str(arg).split("=", 1)[1]
    raise AssertionError(f"no --{name}= in {svc.get('command')}")


def container_ports(svc: dict[str, Any]) -> set[int]:
    ports = {int(p) for p in svc.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1]) for p in svc.get("ports", [])}
    return ports


def bind_mounts(svc: dict[str, Any]) -> list[tuple[Path, str]]:
    out = []
    for vol in svc.get("volumes", []):
        src, dst = str(vol).split(":")[:2]
        if src.startswith((".", "/")):
            out.append(((COMPOSE / src).resolve(), dst))
    return out


def host_path(svc: dict[str, Any], container_path: str) -> Path:
    """The host file a container path of `svc` comes from, through its bind mounts."""
    for src, dst in sorted(bind_mounts(svc), key=lambda m: -len(m[1])):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst) :].lstrip("/")
    raise AssertionError(f"{container_path} is not bind-mounted into the service")


def sidecar_config(stack: dict[str, Any], tmp: Path) -> Any:
    """compose's sidecar.toml through the sidecar's own config loader, container paths mapped to the host
    (the token file, which compose makes from a secret, and the state volume to a temp dir)."""
    from sidecar.client import write_token_file
    from sidecar.config import load_config

    svc = services(stack)["sidecar"]
    toml_path = host_path(svc, flag(svc, "config"))
    raw = tomllib.loads(toml_path.read_text())
    (secret,) = svc["secrets"]
    assert secret in stack["secrets"] and raw["admin_token_file"] == f"/run/secrets/{secret}"
    state = next(str(v).split(":")[1] for v in svc["volumes"] if not str(v).startswith("."))
    assert raw["state_dir"] == state and raw["capture_dir"].startswith(state + "/")
    overrides = {
        "repository": host_path(svc, raw["repository"]),
        "state_dir": tmp / "state",
        "capture_dir": tmp / "state" / "captures",
        "admin_token_file": write_token_file(tmp / "token", "a-token-of-sixteen-or-more"),
    }
    return load_config(toml_path, overrides)


def url_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


# -- docker compose, where it exists ------------------------------------------------------------------


def docker_compose() -> list[str]:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client on PATH; the structural checks below cover the compose file")
    probe = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        first_line = (probe.stderr.strip().splitlines() or [""])[0]
        pytest.skip(
            f"the docker compose plugin is not installed ({first_line[:120]}); structural checks only"
        )
    return [docker, "compose", "-f", str(COMPOSE_FILE), "-f", str(GPU_FILE), "--profile", "load"]


def test_docker_compose_config() -> None:
    cmd = docker_compose()
    proc = subprocess.run(
        [*cmd, "config", "--format", "json"], capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, **REQUIRED_ENV},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert set(config["services"]) == SERVICES
    # The admin token and the Grafana password are required, never defaulted.
    env = {k: v for k, v in os.environ.items() if k not in REQUIRED_ENV}
    missing = subprocess.run(
        [*cmd, "config"], capture_output=True, text=True, timeout=60, check=False, env=env
    )
    assert missing.returncode != 0 and "TUNEGATE_ADMIN_TOKEN" in missing.stderr


# -- structure ----------------------------------------------------------------------------------------


def test_every_image_is_pinned(stack: dict[str, Any]) -> None:
    assert set(services(stack)) >= SERVICES
    for name, svc in services(stack).items():
        image = svc.get("image", "")
        assert image and "${" not in image, f"{name}: no literal image"
        if "@sha256:" in image:
            continue
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned to a version"
    # The images built here carry the package version and are never pulled from a registry.
    for name, svc in services(stack).items():
        if "build" in svc:
            assert svc["image"].endswith(":" + importlib.metadata.version("tunegate")), name
            assert svc["pull_policy"] == "build", name


def test_triton_is_the_ngc_release_of_the_embedded_server(stack: dict[str, Any]) -> None:
    image = services(stack)["triton"]["image"]
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3", image)
    assert m, image
    # NGC YY.MM ships Triton 2.N with N = 12*(YY-24) + MM + 41 (24.10 -> 2.51, 23.10 -> 2.39).
    minor = 12 * (int(m.group(1)) - 24) + int(m.group(2)) + 41
    # tritonclient is pinned to the release line of the server the pytriton wheel bundles.
    client = importlib.metadata.version("tritonclient").split(".")
    assert (int(client[0]), int(client[1])) == (2, minor)


def test_sidecar_config_is_valid_for_the_sidecar(stack: dict[str, Any], tmp_path: Path) -> None:
    config = sidecar_config(stack, tmp_path)
    assert config.admin_token is not None and config.capture_rate > 0
    assert 0 < config.canary.sample_rate <= 1 and config.canary.deadline_s > 0


def test_triton_uses_explicit_model_control_on_the_shared_repository(
    stack: dict[str, Any], tmp_path: Path
) -> None:
    triton = services(stack)["triton"]
    assert flag(triton, "model-control-mode") == "explicit"
    repo = host_path(triton, flag(triton, "model-repository"))
    # The sidecar edits the very same directory (canary model, version policy) for promotion.
    assert sidecar_config(stack, tmp_path).repository == repo
    for arg in triton["command"]:
        if str(arg).startswith("--load-model="):
            config = repo / str(arg).split("=", 1)[1] / "config.pbtxt"
            assert config.is_file(), config
            # Production serves natively (no python backend in the NGC image's Python).
            assert re.search(
                r'^(backend: "onnxruntime"|platform: "tensorrt_plan")$', config.read_text(), re.MULTILINE
            )


def test_native_repository_config_is_what_the_writer_emits() -> None:
    from tunegate import models

    native = models.minilm_native_config()
    committed = COMPOSE / "model_repository" / native.name / "config.pbtxt"
    assert committed.read_text() == native.pbtxt(), (
        "regenerate: tunegate model native --dest compose/model_repository"
    )


def test_every_mounted_path_exists(stack: dict[str, Any]) -> None:
    named = set(stack.get("volumes") or {})
    for name, svc in services(stack).items():
        for vol in svc.get("volumes", []):
            src = str(vol).split(":")[0]
            if src.startswith((".", "/")):
                assert (COMPOSE / src).exists(), f"{name}: {src} does not exist"
            else:
                assert src in named, f"{name}: volume {src} is not declared"
        if "build" in svc:
            context = (COMPOSE / svc["build"]["context"]).resolve()
            assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file(), name


def test_files_the_containers_read_exist(stack: dict[str, Any]) -> None:
    svcs = services(stack)
    prometheus = svcs["prometheus"]
    prom_config = host_path(prometheus, flag(prometheus, "config.file"))
    assert prom_config == PROM_DIR / "prometheus.yml"
    # Rule globs are relative to the config file; they must match the mounted rules.
    for pattern in load_yaml(prom_config)["rule_files"]:
        assert list(prom_config.parent.glob(pattern)), pattern
        assert host_path(prometheus, f"/etc/prometheus/{pattern.split('*')[0]}").is_dir()
    grafana = svcs["grafana"]
    home = host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.is_file()
    provider = load_yaml(COMPOSE / "grafana" / "provisioning" / "dashboards" / "tunegate.yml")["providers"][0]
    assert host_path(grafana, provider["options"]["path"]) == home.parent
    assert host_path(grafana, "/etc/grafana/provisioning/datasources").is_dir()
    for name in ("locust-master", "locust-worker"):
        svc = svcs[name]
        locustfile = svc["command"][svc["command"].index("-f") + 1]
        assert host_path(svc, locustfile) == ROOT / "loadtest" / "locustfile.py"


def test_ports_are_consistent_with_the_configs(stack: dict[str, Any], tmp_path: Path) -> None:
    svcs = services(stack)
    sidecar = sidecar_config(stack, tmp_path)
    assert sidecar.listen_host == "0.0.0.0", "the sidecar must listen on the container's network"
    listens = {
        "sidecar": sidecar.listen_port,
        "triton-http": int(flag(svcs["triton"], "http-port")),
        "triton-metrics": int(flag(svcs["triton"], "metrics-port")),
        "prometheus": 9090,  # its default; no --web.listen-address
    }
    assert not any(str(a).startswith("--web.listen-address") for a in svcs["prometheus"]["command"])
    where = {
        "sidecar": "sidecar",
        "triton-http": "triton",
        "triton-metrics": "triton",
        "prometheus": "prometheus",
    }
    for key, port in listens.items():
        name = where[key]
        assert port in container_ports(svcs[name]), f"{name} does not expose {port}"
    # Prometheus scrapes the sidecar's KServe port and Triton's metrics port.
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in load_yaml(PROM_DIR / "prometheus.yml")["scrape_configs"]
    }
    assert targets == {
        "tunegate-sidecar": [f"sidecar:{listens['sidecar']}"],
        "triton": [f"triton:{listens['triton-metrics']}"],
    }
    assert url_port(sidecar.upstream) == ("triton", listens["triton-http"])
    datasource = load_yaml(COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ][0]
    assert url_port(datasource["url"]) == ("prometheus", listens["prometheus"])
    assert url_port(flag(svcs["locust-master"], "host")) == ("sidecar", listens["sidecar"])
    assert flag(svcs["locust-worker"], "master-host") == "locust-master"
    # Published host ports are unique; Triton publishes none (clients go through the sidecar).
    published = [str(p).split(":")[0] for svc in svcs.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published))
    assert "ports" not in svcs["triton"]


def test_locust_replays_the_sidecars_captures(stack: dict[str, Any]) -> None:
    svcs = services(stack)
    state = next(v for v in svcs["sidecar"]["volumes"] if not str(v).startswith("."))
    volume, path = str(state).split(":")[:2]
    svc = svcs["sidecar"]
    captures = tomllib.loads(host_path(svc, flag(svc, "config")).read_text())["capture_dir"]
    for name in ("locust-master", "locust-worker"):
        svc = svcs[name]
        assert svc["profiles"] == ["load"]
        assert f"{volume}:{path}:ro" in svc["volumes"]
        # By default Locust replays the directory the sidecar captures into.
        default = (
            svc["environment"]["TUNEGATE_CAPTURE"].removeprefix("${TUNEGATE_CAPTURE:-").removesuffix("}")
        )
        assert default == captures


def test_gpu_override_reserves_gpus_for_triton_only() -> None:
    override = load_yaml(GPU_FILE)
    assert set(override["services"]) == {"triton"}
    (device,) = override["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_dockerfile_is_pinned_non_root_and_copies_what_exists(stack: dict[str, Any], tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    # A build stage for the compiled gRPC front, then the runtime image, on one pinned base.
    bases = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert len(set(bases)) == 1 and re.fullmatch(r"python:3\.11\.\d+-slim-\w+", bases[0]), bases
    assert "COPY --from=front /usr/local/bin/tunegate-grpc-front" in text
    # The build context is the repository root; the ignore file lets in only what is copied.
    lines = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ignore[0] == "**" and "**/*.onnx" in ignore
    for src in re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, re.MULTILINE):
        for item in src.split():
            assert (ROOT / item).exists(), item
            assert f"!{item}" in ignore or f"!{item}/" in ignore, f"{item} is excluded from the build context"
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")
    (exposed,) = re.findall(r"^EXPOSE\s+(\d+)", text, re.MULTILINE)
    assert int(exposed) == sidecar_config(stack, tmp_path).listen_port
