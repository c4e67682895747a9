"""Static checks of the deployment files in deploy/ (CPU only, no Docker engine).

- the Dockerfile builds on the vLLM image of the version the project is tested against;
- every path it COPYs exists, and its .dockerignore allow-list matches the COPY list;
- compose, Kubernetes and Ray files parse, ask for 2 GPUs, probe /health, and set the
  NVLink-multicast-off environment in every service / container / `ray start`;
- no file under deploy/ turns multicast back on (NCCL_NVLS_ENABLE=1, FlashInfer "mnnvl");
- compose publishes every port on loopback unless a variable says otherwise, starts
  Locust (and its web UI) only under its profile, and passes the host's VLLM_API_KEY to
  vLLM and to the locustfile, which sends it as a bearer token;
- Kubernetes manifests validate against the real Kubernetes JSON schemas
  (kubernetes-validate ships them, no network); the LeaderWorkerSet CRD, which has no
  built-in schema, is checked with a minimal schema of the fields we use, and its pod
  templates against the real PodTemplate schema.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
import yali_vllm

from benchmarks.common.gpu_env import MULTICAST_OFF_ENV

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
RAY_CLUSTER = DEPLOY / "ray" / "cluster.yaml"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
VERSION_FILE = Path(yali_vllm.__file__).parent / "_version.py"  # the checkout's, or the installed wheel's
LOCUSTFILE = REPO / "benchmarks" / "locustfile.py"

# Oldest Kubernetes we claim to support, and the newest schema set the validator ships.
K8S_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]


# ----------------------------------------------------------------------------- helpers
def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def copy_sources() -> list[str]:
    """Build-context paths that COPY/ADD take (multi-stage `--from=` copies skipped)."""
    sources: list[str] = []
    for instr, args in dockerfile_instructions():
        if instr not in ("COPY", "ADD"):
            continue
        if args.startswith("["):
            parts = json.loads(args)
        else:
            parts = shlex.split(args)
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue
        paths = [p for p in parts if not p.startswith("--")]
        assert len(paths) >= 2, f"{instr} {args}: needs a source and a destination"
        sources += [p.rstrip("/").removeprefix("./") or "." for p in paths[:-1]]
    return sources


def load_yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def walk(node: Any) -> Iterator[Any]:
    """Every dict, list and scalar inside a parsed YAML document."""
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def pod_specs(doc: Any) -> Iterator[dict]:
    """Every pod spec (a mapping with a `containers` list) inside a manifest."""
    for node in walk(doc):
        if isinstance(node, dict) and isinstance(node.get("containers"), list):
            yield node


def all_containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def k8s_env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


# ${VAR}, ${VAR:-default}, ${VAR-default}: compose's interpolation of a shell variable.
_COMPOSE_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose_defaults(value: str) -> str:
    """`value` as compose interpolates it when none of its variables is set: each
    `${VAR:-default}` / `${VAR-default}` becomes its default, a bare `${VAR}` ''."""
    return _COMPOSE_VAR.sub(lambda m: m.group(2) or "", value)


def published_host_ips(service: dict) -> list[tuple[str, str]]:
    """(host address, port entry) for each published port, variables at their defaults.
    An entry without an address ("8000:8000", "8000", long syntax without host_ip) is
    published on every interface: its address is ''."""
    out: list[tuple[str, str]] = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):  # long syntax
            out.append((compose_defaults(str(entry.get("host_ip", ""))), str(entry)))
            continue
        spec = compose_defaults(str(entry)).split("/", 1)[0]  # drop "/tcp", "/udp"
        if spec.startswith("["):  # "[::1]:8000:8000"
            host = spec[1:spec.index("]")]
        else:
            parts = spec.rsplit(":", 2)
            host = parts[0] if len(parts) == 3 else ""
        out.append((host, str(entry)))
    return out


def assert_multicast_off(env: dict[str, Any], where: str) -> None:
    for name, value in MULTICAST_OFF_ENV.items():
        assert env.get(name) == value, f"{where}: {name} must be {value!r}, is {env.get(name)!r}"


def strip_comments(text: str) -> str:
    """Drop `# ...` comments (at line start or after whitespace) from YAML/shell/Docker text."""
    return "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


# ------------------------------------------------------------------------ (a) base tag
def test_dockerfile_base_tag_is_the_tested_vllm():
    instrs = dockerfile_instructions()
    args = dict(a.partition("=")[::2] for i, a in instrs if i == "ARG" and "=" in a)
    froms = [a for i, a in instrs if i == "FROM"]
    assert froms == ["vllm/vllm-openai:v${VLLM_VERSION}"], froms
    docker_version = args["VLLM_VERSION"]
    # compose builds the same image with the same version
    compose = yaml.safe_load(COMPOSE.read_text())
    assert compose["services"]["vllm"]["build"]["args"]["VLLM_VERSION"] == docker_version
    if not VERSION_FILE.exists():
        pytest.skip(f"{VERSION_FILE} does not exist yet")
    m = re.search(r"""^TESTED_VLLM_VERSION\s*(?::\s*\w+\s*)?=\s*["']([^"']+)["']""",
                  VERSION_FILE.read_text(), re.M)
    assert m, f"TESTED_VLLM_VERSION = '...' not found in {VERSION_FILE}"
    assert docker_version == m.group(1), (
        f"deploy/Dockerfile builds on vLLM {docker_version}, tests run against {m.group(1)}")


# ------------------------------------------------------------------------ (b) COPY paths
def test_dockerfile_copy_sources_exist():
    sources = copy_sources()
    assert sources, "deploy/Dockerfile copies nothing from the repo"
    missing = [s for s in sources if not list(REPO.glob(s))]
    assert not missing, f"deploy/Dockerfile COPYs paths missing from the repo: {missing}"


def test_dockerignore_allows_exactly_the_copied_paths():
    # BuildKit reads deploy/Dockerfile.dockerignore for deploy/Dockerfile: an allow-list
    # ('*' then '!path'). A COPY source it excludes would fail the build.
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", "the .dockerignore should start by excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert allowed == set(copy_sources())


def test_dockerfile_sets_multicast_off_and_keeps_entrypoint():
    env: dict[str, str] = {}
    for instr, args in dockerfile_instructions():
        assert instr not in ("ENTRYPOINT", "CMD"), "keep the vLLM image's entry point"
        if instr == "ENV":
            env.update(p.split("=", 1) for p in shlex.split(args))
    assert_multicast_off(env, "deploy/Dockerfile ENV")
    run = " ".join(a for i, a in dockerfile_instructions() if i in ("RUN", "ARG"))
    assert "TORCH_CUDA_ARCH_LIST=9.0a" in run
    assert "--no-build-isolation" in run


# --------------------------------------------------------------------------- (c) compose
def test_compose_serves_on_two_gpus_with_health_check():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    serve = services["vllm"]
    script = " ".join(map(str, serve.get("entrypoint", []) + serve.get("command", [])))
    assert "yali-vllm-model /models/llama-70b --size 70b" in script
    assert re.search(r"vllm serve /models/llama-70b .*--tensor-parallel-size 2", script, re.S)
    assert "--load-format dummy" in script and "--tokenizer-mode mistral" in script
    devices = serve["deploy"]["resources"]["reservations"]["devices"]
    gpus = [d for d in devices if "gpu" in d.get("capabilities", [])]
    assert len(gpus) == 1 and gpus[0]["count"] == 2, devices
    assert serve["ipc"] == "host" and serve.get("shm_size")
    assert "/health" in " ".join(serve["healthcheck"]["test"])
    locust = services["locust"]
    assert locust["image"].startswith("locustio/locust")
    assert any(v.startswith("../benchmarks/locustfile.py:") for v in locust["volumes"])
    assert locust["depends_on"]["vllm"]["condition"] == "service_healthy"


def test_multicast_off_in_every_compose_service():
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        assert_multicast_off(compose_env(service), f"compose service {name}")


def test_compose_publishes_ports_on_loopback_by_default():
    compose = yaml.safe_load(COMPOSE.read_text())
    seen = []
    for name, service in compose["services"].items():
        assert service.get("network_mode") != "host", f"{name}: network_mode host skips `ports`"
        for host, entry in published_host_ips(service):
            seen.append(entry)
            assert host, f"{name}: {entry!r} is published on every interface by default"
            assert ipaddress.ip_address(host).is_loopback, (
                f"{name}: {entry!r} is published on {host} by default, not on loopback")
    assert len(seen) >= 2, seen  # vLLM's API and Locust's UI


def test_compose_locust_ui_only_under_its_profile():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert not services["vllm"].get("profiles"), "vllm must start with a plain `up`"
    publishes_ui = [n for n, s in services.items()
                    if any(re.search(r"(^|:)8089(/\w+)?$", compose_defaults(str(p)))
                           for p in s.get("ports", []))]
    assert publishes_ui == ["locust"], publishes_ui
    assert services["locust"].get("profiles"), "locust (web UI on 8089) needs a profile"
    assert "--host http://vllm:8000" in str(services["locust"]["command"])


def test_compose_passes_the_api_key_through():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    serve = services["vllm"]
    key = compose_env(serve).get("VLLM_API_KEY")
    assert key is not None and re.fullmatch(r"\$\{VLLM_API_KEY(:?-)?\}", key), (
        f"vllm: VLLM_API_KEY should come from the host's environment, is {key!r}")
    # Unset on the host, it is '' in the container; vLLM keeps only non-empty keys, so the
    # API then runs without authentication rather than with an empty key.
    assert compose_defaults(key) == ""
    script = " ".join(map(str, serve.get("entrypoint", []) + serve.get("command", [])))
    assert "--api-key" not in script, "the key comes from VLLM_API_KEY, not the command line"
    # The health check stays outside /v1, the only paths vLLM's key protects.
    (url,) = re.findall(r"https?://[^'\"\s]+", " ".join(serve["healthcheck"]["test"]))
    assert re.match(r"https?://[^/]+/health$", url), url
    load_key = compose_env(services["locust"]).get("LOAD_API_KEY", "")
    assert re.fullmatch(r"\$\{VLLM_API_KEY(:?-)?\}", load_key), (
        f"locust: LOAD_API_KEY should be vLLM's key, is {load_key!r}")


@pytest.mark.parametrize("key", ["s3cret", ""])
def test_locustfile_sends_the_api_key(key):
    if importlib.util.find_spec("locust") is None:
        pytest.skip("locust not installed")
    # in a subprocess: importing locust monkey-patches the interpreter (gevent)
    code = textwrap.dedent(
        f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("lf", {str(LOCUSTFILE)!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        m._StreamingUser._model_name = "m"  # no /v1/models discovery
        user = object.__new__(m.ChatCompletionsUser)
        user.on_start()
        print(json.dumps(dict(user.session.headers)))
        """
    )
    env = dict(os.environ, LOAD_API_KEY=key)
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, env=env)
    assert cp.returncode == 0, cp.stderr
    headers = json.loads(cp.stdout.strip().splitlines()[-1])
    if key:
        assert headers.get("Authorization") == f"Bearer {key}", headers
    else:
        assert "Authorization" not in headers, headers


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_multicast_off_in_every_k8s_container(path):
    specs = [s for d in load_yaml_docs(path) for s in pod_specs(d)]
    for spec in specs:
        for c in all_containers(spec):
            env = k8s_env(c)
            assert_multicast_off(env, f"{path.name} container {c['name']}")
            assert env.get("YALI_ENABLE") == "1", f"{path.name} {c['name']}: YALI_ENABLE"


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_no_file_turns_multicast_on(path):
    text = strip_comments(path.read_text())
    assert "mnnvl" not in text.lower(), f"{path}: 'mnnvl' must never be used"
    # every `NAME=value` / `NAME: value` assignment of a multicast variable has the off value
    for name, value in MULTICAST_OFF_ENV.items():
        for m in re.finditer(rf"\b{name}\b\s*[=:]\s*[\"']?([^\s\"']+)", text):
            assert m.group(1) == value, f"{path}: {name} set to {m.group(1)!r}"
    if path.suffix in (".yaml", ".yml"):  # k8s `- name: X` / `value: Y` pairs
        for doc in load_yaml_docs(path):
            for node in walk(doc):
                if isinstance(node, dict) and node.get("name") in MULTICAST_OFF_ENV:
                    assert str(node.get("value")) == MULTICAST_OFF_ENV[node["name"]], (path, node)


# ----------------------------------------------------------------------- (d) Kubernetes
# Minimal structure of the LeaderWorkerSet fields we rely on; key sets follow the
# leaderworkerset.x-k8s.io/v1 CRD, so a misspelt key is caught. Pod templates inside are
# validated separately against the real PodTemplate schema.
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 1},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["size", "leaderTemplate", "workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 2},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart",
                                                   "RecreateGroupAfterStart", "None"]},
                        "leaderTemplate": {"type": "object", "required": ["spec"]},
                        "workerTemplate": {"type": "object", "required": ["spec"]},
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                        "persistentVolumeClaimRetentionPolicy": {"type": "object"},
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): LWS_SCHEMA}

K8S_DOCS = [(p, i, d) for p in K8S_FILES for i, d in enumerate(load_yaml_docs(p))]


def test_k8s_manifests_present():
    kinds = {d["kind"] for _, _, d in K8S_DOCS}
    assert {"Deployment", "Service", "LeaderWorkerSet"} <= kinds, kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path,index,doc", K8S_DOCS,
                         ids=[f"{p.name}#{i}-{d['kind']}" for p, i, d in K8S_DOCS])
def test_k8s_manifest_validates(path, index, doc, version):
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is None:  # core kind: the real schema, unknown fields rejected (strict)
        kubernetes_validate.validate(doc, version, strict=True)
        return
    jsonschema.validate(doc, crd)
    for spec in pod_specs(doc):  # each embedded pod template against PodTemplate
        template = next(t for t in walk(doc) if isinstance(t, dict) and t.get("spec") is spec)
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{doc['metadata']['name']}-template"},
                        "template": template}
        kubernetes_validate.validate(pod_template, version, strict=True)


def _gpu_count(container: dict) -> int:
    limits = container.get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def test_k8s_deployment_layout():
    (dep,) = [d for _, _, d in K8S_DOCS if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    (server,) = [c for c in spec["containers"] if _gpu_count(c) == 2]
    for probe in ("readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": 8000}, probe
    assert " ".join(server["command"] + server["args"]).startswith("vllm serve")
    assert "--tensor-parallel-size=2" in server["args"]
    shm = {v["name"]: v for v in spec["volumes"]}
    (mount,) = [m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm[mount["name"]]["emptyDir"]["medium"] == "Memory"
    services = [d for _, _, d in K8S_DOCS if d["kind"] == "Service"]
    assert any(s["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"]
               .items() for s in services), "no Service selects the Deployment's pods"


def test_k8s_leaderworkerset_layout():
    (lws,) = [d for _, _, d in K8S_DOCS if d["kind"] == "LeaderWorkerSet"]
    lwt = lws["spec"]["leaderWorkerTemplate"]
    (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
    (worker,) = lwt["workerTemplate"]["spec"]["containers"]
    assert _gpu_count(leader) == 2 and _gpu_count(worker) == 2
    lead_script = " ".join(leader["command"] + leader["args"])
    for flag in ("ray start --head", "--distributed-executor-backend ray",
                 "--tensor-parallel-size 2", '--pipeline-parallel-size "${LWS_GROUP_SIZE}"'):
        assert flag in lead_script, flag
    assert "ray start --address" in " ".join(worker["command"] + worker["args"])
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}


# ------------------------------------------------------------------------------ (e) Ray
def test_ray_cluster_config_commands_carry_multicast_off():
    cfg = yaml.safe_load(RAY_CLUSTER.read_text())
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in cfg[key] if "ray start" in c]
    assert len(starts) == 2, starts
    for cmd in starts:
        for name, value in MULTICAST_OFF_ENV.items():
            assert f"{name}={value}" in cmd.split(), f"{name}={value} missing from: {cmd}"
        assert "--num-gpus=2" in cmd
    run_options = cfg["docker"]["run_options"]
    for name, value in MULTICAST_OFF_ENV.items():
        assert f"-e {name}={value}" in run_options


def test_ray_cluster_config_matches_ray_schema():
    # Ray's own schema ships in the ray wheel (GPU hosts have it; CI usually does not).
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        pytest.skip("ray is not installed: its cluster-config schema is not available")
    schema_path = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(yaml.safe_load(RAY_CLUSTER.read_text()), schema)


def test_scaling_doc_has_the_local_ray_start():
    doc = (REPO / "docs" / "SCALING.md").read_text()
    assert "ray start --head --node-ip-address 127.0.0.1" in doc
    assert "--pipeline-parallel-size" in doc
