"""deploy/k8s-vllm, the kustomize overlay that runs the verifier's target on vLLM over several
GPUs: rendered (by a small strategic-merge renderer here, and by kubectl's own kustomize
where kubectl is installed, the two compared), every object validated like the base's, and
the properties that make it work checked: --engine vllm with a tensor-parallel size equal to
the GPUs the pod gets, shared memory for the workers, a startup long enough for a 70B load,
the model volume, and nothing but the verifier and its autoscaler differing from the base.

The overlay sits beside deploy/k8s, not inside it: kustomize refuses an overlay below its
base's directory ("cycle detected")."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "deploy" / "k8s"
OVERLAY = REPO / "deploy" / "k8s-vllm"
VERSIONS = ("1.36", "1.37")  # as tests/test_k8s.py
# Strategic merge keys of the lists the overlay patches (Kubernetes' own, for these fields);
# any other list is replaced, as in a strategic merge.
MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort"}


def key(doc: dict) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, list) and k in MERGE_KEYS and isinstance(dst.get(k), list):
            for item in v:
                same = [x for x in dst[k] if x[MERGE_KEYS[k]] == item[MERGE_KEYS[k]]]
                if same:
                    merge(same[0], item)
                else:
                    dst[k].append(copy.deepcopy(item))
        else:
            dst[k] = copy.deepcopy(v)


def json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902, the operations the overlay uses (test, remove, add, replace)."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].lstrip("/").split("/")]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        index = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "test":
            if node[index] != op["value"]:
                raise ValueError(f"test failed at {op['path']}: {node[index]!r}")
        elif op["op"] == "remove":
            del node[index]
        elif op["op"] == "replace":
            node[index] = op["value"]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if index == "-" else index, op["value"])
        elif op["op"] == "add":
            node[index] = op["value"]
        else:
            raise ValueError(f"unsupported operation {op['op']}")


def render(root: Path) -> list[dict]:
    """What `kubectl kustomize root` gives, for the features this repo's kustomizations use:
    resources (files and directories), patches (strategic merge, or JSON 6902 with a
    target) and image tags."""
    k = yaml.safe_load((root / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for r in k.get("resources", []):
        path = root / r
        docs += render(path) if path.is_dir() else \
            [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        body = yaml.safe_load((root / patch["path"]).read_text())
        if isinstance(body, list):
            t = patch["target"]
            [doc] = [d for d in docs if d["kind"] == t["kind"]
                     and d["metadata"]["name"] == t["name"]]
            json_patch(doc, body)
        else:
            [doc] = [d for d in docs if key(d) == key(body)]
            merge(doc, body)
    for image in k.get("images", []):
        for doc in docs:
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []):
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def by_key(docs: list[dict]) -> dict[tuple, dict]:
    out = {key(d): d for d in docs}
    assert len(out) == len(docs), "two objects of one kind, namespace and name"
    return out


@pytest.fixture(scope="module")
def base() -> dict[tuple, dict]:
    return by_key(render(BASE))


@pytest.fixture(scope="module")
def overlay() -> dict[tuple, dict]:
    return by_key(render(OVERLAY))


def verifier(docs: dict) -> tuple[dict, dict]:
    """(pod spec, container) of the verifier StatefulSet."""
    pod = docs["StatefulSet", "edgespec", "verifier"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    return pod, c


def arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def shard_problems(docs: dict) -> list[str]:
    """What would stop a tensor-parallel verifier pod from starting: returned, not asserted,
    so that a test can show it finds them in a broken copy."""
    pod, c = verifier(docs)
    problems = []
    tp = int(arg(c["args"], "--tensor-parallel-size"))
    for side in ("requests", "limits"):
        if c["resources"][side].get("nvidia.com/gpu") != tp:
            problems.append(f"{side} nvidia.com/gpu != --tensor-parallel-size {tp}")
    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    if not shm or volumes[shm[0]["name"]].get("emptyDir", {}).get("medium") != "Memory":
        problems.append("no memory-backed /dev/shm")
    return problems


def test_every_overlay_file_is_used_and_the_base_is_the_real_one():
    k = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    used = {r for r in k["resources"] if r.endswith(".yaml")} | {p["path"] for p in k["patches"]}
    on_disk = {p.name for p in OVERLAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert used == on_disk
    assert [r for r in k["resources"] if (OVERLAY / r).is_dir()] == ["../k8s"]
    assert (OVERLAY / "../k8s").resolve() == BASE


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_validates_strictly(overlay, version):
    for doc in overlay.values():
        kubernetes_validate.validate(doc, version, strict=True)
    assert len(overlay) >= 16


def test_kubectl_kustomize_renders_the_same(overlay):
    """The renderer here against kustomize itself (kubectl's, where installed): same objects,
    lists compared in a canonical order (kustomize orders merged list items its own way)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay is checked by the renderer alone")
    out = subprocess.run([kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = by_key([d for d in yaml.safe_load_all(out.stdout) if d])
    assert set(theirs) == set(overlay)
    for k, doc in overlay.items():
        assert canonical(theirs[k]) == canonical(doc), k


def canonical(node):
    if isinstance(node, dict):
        return {k: canonical(v) for k, v in node.items()}
    if isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
        items = [canonical(x) for x in node]
        for mk in ("name", "mountPath"):
            if all(mk in x for x in items):
                return sorted(items, key=lambda x: str(x[mk]))
        return items
    return node


def test_kustomize_refuses_the_hpa_patch_on_a_reordered_base(tmp_path):
    """The JSON patch's "test" guards the removal by index: with the base's metrics in the
    other order, rendering fails instead of removing the wrong metric."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    shutil.copytree(BASE, tmp_path / "k8s")
    shutil.copytree(OVERLAY, tmp_path / "k8s-vllm")
    hpa_file = tmp_path / "k8s" / "autoscaling.yaml"
    docs = list(yaml.safe_load_all(hpa_file.read_text()))
    docs[0]["spec"]["metrics"].reverse()
    hpa_file.write_text(yaml.safe_dump_all(docs))
    out = subprocess.run([kubectl, "kustomize", str(tmp_path / "k8s-vllm")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    with pytest.raises(ValueError, match="test failed"):
        render(tmp_path / "k8s-vllm")


def test_the_verifier_runs_vllm_with_a_gpu_per_shard(overlay):
    import cloud_verifier.server as server

    pod, c = verifier(overlay)
    args, config = server.parse_args(c["args"])  # the verifier's own parser accepts them
    assert args.engine == "vllm"
    assert args.dtype == "bfloat16"
    assert 0.5 <= args.gpu_memory_utilization < 1
    assert args.tensor_parallel_size > 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == args.tensor_parallel_size
    assert c["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel_size
    assert config.kv_budget_bytes is None  # vLLM sizes its own KV cache
    assert shard_problems(overlay) == []
    # The base's drain, kept: the pod outlives --grace.
    assert pod["terminationGracePeriodSeconds"] >= config.grace_s + 30
    assert "kill -TERM 1" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])


def test_the_shard_check_finds_a_mismatch(overlay):
    broken = copy.deepcopy(overlay)
    pod, c = verifier(broken)
    c["args"][c["args"].index("--tensor-parallel-size") + 1] = "2"
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]
    assert len(shard_problems(broken)) == 3


def test_shared_memory_fits_in_the_memory_limit(overlay):
    pod, c = verifier(overlay)
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [shm] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    gib = {"Gi": 1, "Mi": 1 / 1024}

    def size(q: str) -> float:
        return float(q[:-2]) * gib[q[-2:]]
    # tmpfs pages count in the container's memory: the limit must leave room beyond them.
    assert size(c["resources"]["limits"]["memory"]) >= 4 * size(shm["emptyDir"]["sizeLimit"])


def test_the_model_comes_from_the_overlays_volume(overlay):
    pod, c = verifier(overlay)
    model = arg(c["args"], "--model")
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == model]
    assert mount.get("readOnly") is True
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    pvc = overlay["PersistentVolumeClaim", "edgespec", claim]
    # Every replica mounts it at once, possibly on different nodes.
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}
    # A 70B checkpoint in bf16 is about 141 GB.
    assert pvc["spec"]["resources"]["requests"]["storage"].endswith("Gi")
    assert int(pvc["spec"]["resources"]["requests"]["storage"][:-2]) >= 150


def test_probes_wait_for_a_70b_load_and_readiness_is_the_bases(base, overlay):
    from shared.pb import verifier_pb2 as pb

    _, c = verifier(overlay)
    _, c0 = verifier(base)
    startup = c["startupProbe"]
    assert startup["grpc"]["port"] == 50051
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    service = pb.DESCRIPTOR.services_by_name["VerifierService"].full_name
    assert c["readinessProbe"] == c0["readinessProbe"]
    assert c["readinessProbe"]["grpc"]["service"] == service
    assert c["livenessProbe"] == c0["livenessProbe"]


def test_the_pods_land_on_gpu_nodes(overlay):
    pod, c = verifier(overlay)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]
    [term] = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    [memory] = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/gpu.memory"]
    assert memory["operator"] == "Gt" and int(memory["values"][0]) >= 75000  # MiB per GPU
    assert "podAntiAffinity" in pod["affinity"]  # the base's spreading, kept
    # The read-only root filesystem stays; vLLM's caches go to the writable /tmp.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HOME", "value": "/tmp"} in c["env"]


def test_the_image_is_the_vllm_variant_at_the_bases_tag(base, overlay):
    _, c = verifier(overlay)
    _, c0 = verifier(base)
    name, tag = c["image"].rsplit(":", 1)
    name0, tag0 = c0["image"].rsplit(":", 1)
    assert name == f"{name0}-vllm"
    assert tag == tag0


def test_only_the_verifier_and_its_autoscaler_change(base, overlay):
    changed = {k for k in base if base[k] != overlay.get(k)}
    assert changed == {("StatefulSet", "edgespec", "verifier"),
                       ("HorizontalPodAutoscaler", "edgespec", "verifier")}
    assert set(overlay) - set(base) == {("PersistentVolumeClaim", "edgespec", "target-model")}
    # The gateway in particular: its Deployment, Service, ConfigMap, PDB as the base's.
    assert [k for k in base if k[2].startswith("gateway")]


def test_the_autoscaler_uses_the_queue_wait_alone(base, overlay):
    hpa = overlay["HorizontalPodAutoscaler", "edgespec", "verifier"]
    hpa0 = base["HorizontalPodAutoscaler", "edgespec", "verifier"]
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == [
        "edgespec_verify_queue_seconds_per_round"]
    # The KV metric is what vLLM leaves at 0 (its ledger holds no bytes).
    from cloud_verifier.vllm_engine import VllmKVLedger
    assert VllmKVLedger.bytes_in_use == 0
    assert {k: v for k, v in hpa["spec"].items() if k != "metrics"} == \
        {k: v for k, v in hpa0["spec"].items() if k != "metrics"}


def test_kubectl_is_there_under_ci():
    """CI's machines have kubectl (the image ships it); the comparison above must not skip
    there unnoticed."""
    if os.environ.get("CI") and shutil.which("kubectl") is None:
        pytest.fail("kubectl is not installed under CI: the kustomize comparison did not run")
