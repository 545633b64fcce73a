"""slurm/sft.sh and slurm/grpo.sh under a real SLURM: a one-node cluster on this machine (Debian's slurmctld,
slurmd and munge, installed here with apt-get when missing), real `sbatch` jobs, and a rank killed mid-run
that torchrun restarts from the latest checkpoint.

The cluster has no cgroups (containers rarely allow them): proctrack/linuxproc tracks a job's processes,
task/none binds nothing, and nothing is accounted (no slurmdbd), so job states are read with `scontrol`.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, read_metrics, tiny_sft_args
from test_grpo_e2e import grpo_args

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
GRPO_STEPS = 16
SAVE_EVERY = 4
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
        "PREEMPTED"}


# ---- a one-node cluster on localhost ----

def install_slurm() -> None:
    """apt-get the daemons once; later runs find them and return at once."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("SLURM is not installed and cannot be here (needs root and apt-get): "
                    f"apt-get install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def start_munged() -> int | None:
    """Reuse a running munged; else start one as the munge user. Returns the pid we started, if any."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return None
    run_dir = Path("/run/munge")
    run_dir.mkdir(exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)     # forks into the background
    for _ in range(50):
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return int((run_dir / "munged.pid").read_text())
        time.sleep(0.1)
    raise AssertionError("munged did not start (see /var/log/munge/munged.log)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, node: str) -> str:
    # 4 CPUs even on 2 cores (config_overrides accepts more than the hardware has): the tiny GRPO job asks for 3.
    return f"""\
ClusterName=forgetest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
MpiDefault=none
NodeName={node} NodeAddr=127.0.0.1 CPUs={max(os.cpu_count() or 1, 4)} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """slurmctld + slurmd on localhost with their own config, state and ports; jobs run as this user."""

    def __init__(self, root: Path):
        self.root, self.node = root, socket.gethostname().split(".")[0]
        for d in ("state", "spool", "jobs"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "slurm.conf").write_text(slurm_conf(root, self.node))
        # sbatch passes this environment on to the job: the venv's python and torchrun, no outer SLURM job.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {
            "SLURM_CONF": str(root / "slurm.conf"), "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
        self.daemons = [subprocess.Popen([*cmd, "-D"], env=self.env, stdout=out, stderr=subprocess.STDOUT)
                        for cmd, out in ((["slurmctld", "-i"], open(root / "slurmctld.out", "w")),
                                         (["slurmd", "-N", self.node], open(root / "slurmd.out", "w")))]
        deadline = time.time() + 60
        while self.node_state() != "idle":
            assert time.time() < deadline and all(d.poll() is None for d in self.daemons), \
                f"the SLURM node did not come up:\n{self.daemon_logs()}"
            time.sleep(0.5)

    def node_state(self) -> str:
        return self.cmd("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).stdout.strip()

    def cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(args, env=self.env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert not check or proc.returncode == 0, f"{' '.join(args)}: {proc.stderr}"
        return proc

    def submit(self, script: str, args: list[str], *sbatch_opts: str) -> str:
        """`sbatch [opts] script args` from the repository root; returns the job id."""
        return self.cmd("sbatch", "--parsable", *sbatch_opts, script, *args).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        for _ in range(10):             # slurmctld can miss a reply on a loaded machine; ask again
            proc = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
            if proc.returncode == 0:
                return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            time.sleep(1)
        raise AssertionError(f"scontrol show job {job_id}: {proc.stderr}")

    def wait(self, job_id: str, timeout: float = 300) -> dict[str, str]:
        deadline = time.time() + timeout
        while (job := self.job(job_id))["JobState"] not in DONE:
            if time.time() > deadline:
                self.cmd("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout} s:\n"
                                     f"{log_tail(job)}\n{self.daemon_logs()}")
            time.sleep(1)
        return job

    def daemon_logs(self) -> str:
        return "\n".join(f"--- {name} ---\n{(self.root / name).read_text()[-3000:]}"
                         for name in ("slurmctld.out", "slurmd.out") if (self.root / name).is_file())

    def stop(self) -> None:
        self.cmd("scancel", "--user", str(os.getuid()), check=False)
        for d in reversed(self.daemons):
            d.terminate()
            try:
                d.wait(timeout=20)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


def log_tail(job: dict[str, str], chars: int = 6000) -> str:
    path = Path(job["StdOut"])
    return f"--- {path} ---\n" + (path.read_text()[-chars:] if path.is_file() else "(no log)")


def assert_completed(job: dict[str, str]) -> None:
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), f"{job['JobState']} {job['ExitCode']}\n{log_tail(job)}"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    install_slurm()
    munged = start_munged()
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()
    if munged is not None:
        os.kill(munged, signal.SIGTERM)


# ---- the jobs ----

@pytest.fixture(scope="module")
def grpo_job(slurm, tiny, tmp_path_factory):
    """The uninterrupted GRPO run: the reference for the restarted one."""
    out = tmp_path_factory.mktemp("grpo")
    job_id = slurm.submit("slurm/grpo.sh", ["configs/grpo/tiny.yaml", *slurm_grpo_args(tiny, out)],
                          f"--output={slurm.root}/jobs/%x-%j.out")
    return slurm.wait(job_id), out


def slurm_grpo_args(tiny: Path, out: Path) -> list[str]:
    return grpo_args(tiny, out, "--train.steps", str(GRPO_STEPS), "--ckpt.save_every", str(SAVE_EVERY))[2:]  # config first


def test_sft_job(slurm, tiny, tmp_path):
    """2 ranks from the header's --cpus-per-task; the log goes where the header says (logs/%x-%j.out)."""
    args = tiny_sft_args(tiny, tmp_path, "--train.steps", "20", "--train.log_every", "5", "--train.eval_every", "0",
                         "--data.eval_rows", "16", "--ckpt.save_every", "10")[2:]     # the config goes first
    job = slurm.wait(slurm.submit("slurm/sft.sh", ["configs/sft/tiny.yaml", *args]))
    log = REPO / "logs" / f"forge-sft-{job['JobId']}.out"
    assert Path(job["StdOut"]) == log
    try:
        assert_completed(job)
        assert "1 node(s) x 2 rank(s)" in log.read_text()
    finally:
        log.unlink(missing_ok=True)
    metrics = read_metrics(tmp_path)
    assert sorted(metrics) == [5, 10, 15, 20]
    assert metrics[20]["train/loss"] < metrics[5]["train/loss"]
    assert (tmp_path / "checkpoints" / "step_000020" / "meta.json").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_grpo_job(grpo_job):
    job, out = grpo_job
    assert_completed(job)
    assert "1 node(s) x 3 rank(s)" in Path(job["StdOut"]).read_text()
    assert sorted(read_metrics(out)) == list(range(1, GRPO_STEPS + 1))
    assert (out / "checkpoints" / f"step_{GRPO_STEPS:06d}" / "meta.json").is_file()
    assert (out / "hf" / "model.safetensors").is_file()


def test_killed_rank_restarts_from_its_checkpoint(slurm, tiny, grpo_job, tmp_path):
    """kill -9 the policy rank after the first checkpoint: torchrun (--max_restarts) restarts all ranks, they
    resume from the latest checkpoint, the job still completes, and the steps after the resume reproduce
    the uninterrupted run's."""
    job_id = slurm.submit("slurm/grpo.sh", ["configs/grpo/tiny.yaml", *slurm_grpo_args(tiny, tmp_path)],
                          f"--output={slurm.root}/jobs/%x-%j.out")
    first = tmp_path / "checkpoints" / f"step_{SAVE_EVERY:06d}"
    deadline, polls = time.time() + 240, 0
    while not (first / "meta.json").is_file():
        if polls % 20 == 0:             # the job's state about once a second, the checkpoint 20 times as often
            job = slurm.job(job_id)
            assert time.time() < deadline and job["JobState"] in ("PENDING", "RUNNING"), \
                f"no checkpoint while the job ran ({job['JobState']})\n{log_tail(job)}"
        polls += 1
        time.sleep(0.05)
    victim = policy_rank(tmp_path)
    os.kill(victim, signal.SIGKILL)

    job = slurm.wait(job_id)
    assert_completed(job)
    log = Path(job["StdOut"]).read_text()
    assert "will restart worker group" in log, log_tail(job)
    resumed_at = [int(s) for s in re.findall(r"held-out accuracy at step (\d+):", log)]
    assert resumed_at[0] == 0 and len(resumed_at) == 2 and resumed_at[1] >= SAVE_EVERY, resumed_at
    straight, restarted = read_metrics(grpo_job[1]), read_metrics(tmp_path)
    assert sorted(restarted) == list(range(1, GRPO_STEPS + 1))
    for step in range(resumed_at[1] + 1, GRPO_STEPS + 1):
        for key in ("reward/mean", "loss/entropy", "train/grad_norm"):
            assert restarted[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_the_warning_before_the_time_limit_saves_and_requeues(slurm, tiny, grpo_job, tmp_path):
    """SLURM's warning before the time limit (the wrappers' `--signal=B:USR1@300`; here sent by scancel while the
    ranks start): they save at the end of their first step though no checkpoint was due, rank 0 requeues the
    job, and the requeued run resumes from that step and reproduces the uninterrupted run."""
    args = slurm_grpo_args(tiny, tmp_path)
    args[args.index("--ckpt.save_every") + 1] = "0"           # only the final checkpoint was due
    job_id = slurm.submit("slurm/grpo.sh", ["configs/grpo/tiny.yaml", *args], f"--output={slurm.root}/jobs/%x-%j.out")
    log, deadline = Path(slurm.job(job_id)["StdOut"]), time.time() + 120
    while not (log.is_file() and "launch: job" in log.read_text()):      # printed once the shell traps USR1
        assert time.time() < deadline, f"the job did not start\n{log_tail(slurm.job(job_id))}"
        time.sleep(0.2)
    slurm.cmd("scancel", "--batch", "--signal=USR1", job_id)
    while (job := slurm.job(job_id))["JobState"] != "PENDING":      # requeued
        assert time.time() < deadline + 120 and job["JobState"] not in DONE, log_tail(job)
        time.sleep(0.2)
    # SLURM holds a requeued job for 120 s. Started at once, it failed once: "Killing non-startable batch JobId=4:
    # Job credential revoked": slurmd refuses a credential not newer, in whole seconds, than the revocation of the
    # first run's. So: once the first run's allocation is released (after the revocation), a second more
    while (node := slurm.node_state()) != "idle":
        assert time.time() < deadline + 240, f"the node stayed {node} after the requeue\n{log_tail(job)}"
        time.sleep(0.2)
    time.sleep(1.1)
    slurm.cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    job = slurm.wait(job_id)
    assert_completed(job)
    assert job["Restarts"] == "1", log_tail(job)
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["step_000001", f"step_{GRPO_STEPS:06d}"], (checkpoints, log_tail(job))
    assert "held-out accuracy at step 1:" in Path(job["StdOut"]).read_text(), log_tail(job)
    straight, requeued = read_metrics(grpo_job[1]), read_metrics(tmp_path)
    assert sorted(requeued) == list(range(1, GRPO_STEPS + 1))
    for step in range(2, GRPO_STEPS + 1):
        for key in ("reward/mean", "loss/entropy", "train/grad_norm"):
            assert requeued[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (step, key)
    assert not list((REPO / "logs").glob(f"checkpoint-request-{job_id}")), "the request outlived the checkpoint"


def policy_rank(out_dir: Path) -> int:
    """The pid of the job's rank 0: a torchrun worker (`python -u train_grpo.py ... --out_dir <out_dir>`, RANK=0
    in its environment), not the torchrun agent or srun, whose command lines name the script too."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
            env = (proc / "environ").read_bytes().split(b"\0") if "train_grpo.py" in args else []
        except (OSError, ValueError):
            continue
        if str(out_dir) in args and Path(args[0]).name.startswith("python") and "torch.distributed.run" not in args \
                and b"RANK=0" in env:
            return int(proc.name)
    raise AssertionError(f"no rank-0 worker of {out_dir} found")
