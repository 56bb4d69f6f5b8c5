"""Static checks of the Compose stack and the images (no Docker engine needed): Compose v2 accepts the
file in every profile, hadolint passes the Dockerfile, grace periods outlast the drain, our images
are built (never pulled), third-party ones pinned, and the constraints cover what the images install.
`make test-deploy` (tests/deploy_e2e) runs the stack for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_deploy_configs import MODULES, assert_flags_exist, service_help

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
TOKEN_DIR = "/var/lib/minisgl/internal-token"
# Seconds Docker must leave a service beyond its drain before it kills it (process exit, logs).
GRACE_MARGIN_S = 5.0


def tool(name: str) -> str:
    """A tool requirements-dev.txt installs into the venv (or one on PATH)."""
    path = VENV_BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is missing: `make install` installs it (requirements-dev.txt)"
    return found


def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def ours(service: dict) -> bool:
    return str(service.get("image", "")).startswith("minisgl/")


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("profile", ["cpu", "gpu", "grafana"])
def test_compose_v2_accepts_the_file(profile: str) -> None:
    result = subprocess.run(
        [tool("docker-compose"), "-f", str(COMPOSE_FILE), "--profile", profile, "config", "-q"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def services_of(*profiles: str) -> set[str]:
    """What `docker compose [--profile P ...] up` would start, `.env` applied as Compose does."""
    flags = [arg for p in profiles for arg in ("--profile", p)]
    result = subprocess.run([tool("docker-compose"), *flags, "config", "--services"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_plain_compose_up_is_the_cpu_stack() -> None:
    """A new user's `docker compose up` must start a worker (.env: COMPOSE_PROFILES=cpu), and
    `--profile gpu` the CUDA one instead, never both."""
    plain = services_of()
    assert {"worker", "scheduler", "gateway", "envoy"} <= plain and "worker-cuda" not in plain
    gpu = services_of("gpu")
    assert "worker-cuda" in gpu and "worker" not in gpu


def test_hadolint_passes_the_dockerfile() -> None:
    result = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grace_period_outlasts_the_drain() -> None:
    """Docker sends SIGTERM, waits stop_grace_period, then SIGKILLs: the drain must fit in it."""
    checked = 0
    for name, service in compose()["services"].items():
        if not ours(service) or "command" not in service or service.get("restart") == "no":
            continue
        command = [str(a) for a in service["command"]]
        if "--drain-timeout" in command:
            drain = float(command[command.index("--drain-timeout") + 1])
        else:  # the service's own default, from its --help
            module = name.split("-")[0]
            match = re.search(r"--drain-timeout DRAIN_TIMEOUT\s+[^(]*\(default: ([\d.]+)\)",
                              service_help(module))
            assert match, f"{name}: no --drain-timeout default in --help"
            drain = float(match.group(1))
        grace = seconds(service.get("stop_grace_period", "10s"))  # Docker's default is 10 s
        assert grace >= drain + GRACE_MARGIN_S, f"{name}: grace {grace}s, drain {drain}s"
        checked += 1
    assert checked >= 6  # worker, worker-cuda, scheduler, tokenizer, detokenizer, gateway


def test_our_images_are_built_and_theirs_pinned() -> None:
    services = compose()["services"]
    built = {s["image"] for s in services.values() if ours(s) and "build" in s}
    for name, service in services.items():
        image = str(service["image"])
        if ours(service):
            # Built here or by another service of the file; never pulled from a registry.
            policy = service.get("pull_policy")
            assert (policy == "build" and "build" in service) or (
                policy == "never" and image in built), name
        else:
            repo, _, tag = image.partition(":")
            assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: {image} is not pinned"
    # The stand-ins of scripts/deploy are built under the tags the compose file pins.
    stand_ins = subprocess.run(
        ["bash", "-c", 'source scripts/deploy/common.sh && echo "$ENVOY_IMAGE $PROMETHEUS_IMAGE"'],
        capture_output=True, text=True, cwd=ROOT, timeout=30, check=True).stdout.split()
    assert stand_ins == [services["envoy"]["image"], services["prometheus"]["image"]]
    assert services["grafana"].get("profiles") == ["grafana"]


def test_every_service_has_health_restart_and_the_internal_token() -> None:
    services = compose()["services"]
    init = services["internal-token"]
    assert init["restart"] == "no"
    assert f"internal-token:{TOKEN_DIR}" in init["volumes"]
    for name, service in services.items():
        if not ours(service) or name == "internal-token":
            continue
        assert service["restart"] == "unless-stopped", name
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "minisgl_core.healthcheck"], name
        assert f"internal-token:{TOKEN_DIR}:ro" in service["volumes"], name
        assert service["environment"]["MINISGL_INTERNAL_TOKEN_FILE"] == f"{TOKEN_DIR}/token", name
        depends = service["depends_on"]
        if name != "gateway":  # the gateway waits for services that waited for the token
            assert depends["internal-token"] == {"condition": "service_completed_successfully"}
        for dep in depends.values():
            assert dep["condition"].startswith("service_"), name
    assert services["worker"]["profiles"] == ["cpu"]
    assert services["worker-cuda"]["profiles"] == ["gpu"]
    assert services["worker-cuda"]["networks"]["default"]["aliases"] == ["worker"]
    assert_flags_exist("worker", services["worker-cuda"]["command"])
    assert set(MODULES) <= set(services)


def test_dockerfile_targets_users_and_healthchecks() -> None:
    text = DOCKERFILE.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#"))
    stages = re.split(r"^FROM ", code, flags=re.M)[1:]
    names = {s.split()[2]: s for s in stages if " AS " in s.splitlines()[0]}
    for target in ("gateway", "tokenizer", "scheduler", "worker-cpu", "worker-cuda"):
        stage = names[target]
        assert "USER 10001:10001" in stage, target
        assert re.search(r"HEALTHCHECK .*\n?.*minisgl_core\.healthcheck", stage), target
        if target in ("gateway", "tokenizer", "scheduler"):
            assert "torch" not in stage, f"{target} must not install torch"
    assert "ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04" in text
    # Every file the Dockerfile copies from the build context exists.
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.M):
        for source in sources.split():
            assert list(ROOT.glob(source.rstrip("/"))), source


def test_cpu_constraints_cover_the_runtime_closure() -> None:
    """Every distribution the CPU images install has a pin (versions may trail the dev venv)."""
    pins = {line.split("==")[0] for line in
            (ROOT / "deploy" / "docker" / "constraints-cpu.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    result = subprocess.run([sys.executable, "-c", (
        "import runpy; m = runpy.run_path('scripts/deploy/gen_constraints.py');"
        "print(' '.join(m['closure']()))")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    missing = set(result.stdout.split()) - pins
    assert not missing, f"unpinned: {missing}; run scripts/deploy/gen_constraints.py"
    cuda = (ROOT / "deploy" / "docker" / "constraints-cuda.txt").read_text()
    for pin in ("torch==2.11.0", "triton==3.6.0", "flashinfer-python==0.6.4",
                "apache-tvm-ffi==0.1.15.post2", "grpcio==1.84.0"):
        assert pin in cuda.splitlines(), pin
