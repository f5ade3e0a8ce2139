"""The scheduler examples, run for real: the Slurm batch script with a stand-in `srun` (one
task per node, with Slurm's variables) and the Kubernetes Job's container command (its
environment built from the manifest, the token from its Secret) join a real head on loopback.
Neither puts the token on a command line."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from test_networks import run_head

import elastic_magic as em
from elastic_magic.wire.events import RendezvousCompleted

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SBATCH = EXAMPLES / "slurm" / "join.sbatch"
MANIFEST = EXAMPLES / "kubernetes" / "join-job.yaml"
PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])

PROBE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    (os.environ["GROUP_RANK"], t.item())
""")


def stand_ins(folder: Path, argv_log: Path) -> dict[str, str]:
    """`srun` (each task of `--ntasks-per-node=1` on its own "node", in parallel, with
    Slurm's task variables) and `elastic-magic` (this tree's CLI), both logging their
    command lines; the environment that puts them first on PATH."""
    folder.mkdir()
    srun = folder / "srun"
    srun.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "srun $*" >> {argv_log}
        while [[ "$1" == --* ]]; do shift; done
        pids=()
        for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
          SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" \\
            > "{folder}/task$node.out" 2>&1 &
          pids+=($!)
        done
        rc=0
        for pid in "${{pids[@]}}"; do wait "$pid" || rc=$?; done
        exit $rc
    """))
    cli = folder / "elastic-magic"
    cli.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "elastic-magic $*" >> {argv_log}
        exec {sys.executable} -m elastic_magic.cli "$@"
    """))
    for path in (srun, cli):
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_MAGIC_TOKEN")}
    env["PATH"] = f"{folder}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT,
                                                      env.get("PYTHONPATH")]))
    return env


def manifest() -> tuple[dict, dict]:
    """The Secret and the Job of the Kubernetes example."""
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}
    return documents["Secret"], documents["Job"]


def container_environment(job: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: values, and secretKeyRefs
    resolved against ``secrets``."""
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def expand(words: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word) for word in words]


@pytest.mark.unit
def test_the_kubernetes_job_takes_the_token_from_its_secret_never_a_command_line():
    secret, job = manifest()
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"][:3] == ["elastic-magic", "join", "$(ELASTIC_MAGIC_ENDPOINT)"]
    words = " ".join(container["command"] + container.get("args", []))
    assert "token" not in words.lower()  # neither --token nor a value
    (token_entry,) = [e for e in container["env"] if e["name"] == "ELASTIC_MAGIC_TOKEN"]
    ref = token_entry["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_slurm_and_kubernetes_agents_join_a_real_head(tmp_path, log_dir, recorder):
    argv_log = tmp_path / "argv.log"
    env = stand_ins(tmp_path / "bin", argv_log)
    home = tmp_path / "home"
    (home / ".elastic_magic").mkdir(parents=True)
    # Slurm: 2 nodes, the token in the default file; Kubernetes: 1 pod.
    spec = em.JobSpec.create(1, nnodes=4, log_dir=log_dir, timeout=120)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def on_open(job, endpoint):
        token_file = home / ".elastic_magic" / "token"
        token_file.write_text(job.token + "\n")
        token_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
        slurm = {**env, "HOME": str(home), "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
                 "SLURM_JOB_NODELIST": "node[1-2]"}
        with (tmp_path / "sbatch.out").open("wb") as out:
            procs["slurm"] = subprocess.Popen(["bash", str(SBATCH), endpoint], env=slurm,
                                              cwd=tmp_path, stdout=out, stderr=out,
                                              stdin=subprocess.DEVNULL)
        secret, k8s_job = manifest()
        pod_env = container_environment(k8s_job, {secret["metadata"]["name"]:
                                                  {"token": job.token}})
        pod_env["ELASTIC_MAGIC_ENDPOINT"] = endpoint  # as the user sets it
        (container,) = k8s_job["spec"]["template"]["spec"]["containers"]
        argv = expand(container["command"] + container.get("args", []), pod_env)
        with (tmp_path / "pod.out").open("wb") as out:
            procs["pod"] = subprocess.Popen(
                argv, env={**env, **pod_env, "HOME": str(home)}, cwd=tmp_path, stdout=out,
                stderr=out, stdin=subprocess.DEVNULL)

    result = run_head(spec, PROBE, recorder, on_open=on_open)
    outputs = {name: (tmp_path / f"{name}.out").read_text() for name in ("sbatch", "pod")}
    outputs |= {p.name: p.read_text() for p in (tmp_path / "bin").glob("task*.out")}
    assert result.ok, (result, outputs)
    assert {name: proc.wait(timeout=60) for name, proc in procs.items()} == {
        "slurm": 0, "pod": 0}, outputs
    assert [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)] == [(4, 4)]
    assert sorted(group for group, _ in result.values.values()) == ["0", "1", "2", "3"]
    assert {total for _, total in result.values.values()} == {4.0}
    # srun started one agent per node; no command line carried the token.
    command_lines = argv_log.read_text()
    agents = [line for line in command_lines.splitlines() if line.startswith("elastic-magic")]
    assert len(agents) == 3, command_lines  # 2 from srun, 1 pod
    assert "\nsrun --ntasks-per-node=1 " in f"\n{command_lines}", command_lines
    assert "token" not in command_lines.replace("--token-file", "").replace(
        "/.elastic_magic/token", ""), command_lines
    secret_value = (home / ".elastic_magic" / "token").read_text().strip()
    assert secret_value not in command_lines


def test_the_slurm_script_without_a_token_says_where_to_put_it(tmp_path):
    env = stand_ins(tmp_path / "bin", tmp_path / "argv.log")
    done = subprocess.run(["bash", str(SBATCH), "127.0.0.1:29400"],
                          env={**env, "HOME": str(tmp_path), "SLURM_JOB_NUM_NODES": "1"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "export ELASTIC_MAGIC_TOKEN" in done.stderr and "chmod 600" in done.stderr
    assert not (tmp_path / "argv.log").exists()  # srun never ran


def test_join_help_shows_what_schedulers_need():
    done = subprocess.run([sys.executable, "-m", "elastic_magic.cli", "join", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--token-file", "--nproc", "--log-dir", "--host", "ELASTIC_MAGIC_TOKEN"):
        assert option in done.stdout, done.stdout
