"""Two "nodes" on localhost: two `torchrun --nnodes 2` agents meet at one c10d rendezvous, as on a cluster
without SLURM. Ranks 0-1 (node A) are the policy, rank 2 the reference and rank 3 the reward (node B), so
token ids, rewards and reference logprobs cross the node boundary every step."""

import socket
import sys

from conftest import REPO, assert_same_curve, grpo_args, read_metrics, run_script, script_env, start, stop

STEPS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grpo_across_two_nodes_equals_one_node(tiny, tmp_path):
    args = grpo_args(tiny, tmp_path / "two_nodes", "--train.steps", str(STEPS), "--loss.beta", "0.04",
                     "--layout.policy", "2")
    port = free_port()
    env = {**script_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}     # a fresh store per round (README)
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    agents = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                     "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
                     str(REPO / "train_grpo.py"), *args], log, env) for log in logs]
    try:
        codes = [agent.wait(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            stop(agent)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)

    one_node = tmp_path / "one_node"
    run_script("train_grpo.py", grpo_args(tiny, one_node, "--train.steps", str(STEPS), "--loss.beta", "0.04",
                                          "--layout.policy", "2"), nproc=4)
    two, one = read_metrics(tmp_path / "two_nodes"), read_metrics(one_node)
    assert_same_curve(two, one, range(1, STEPS + 1), keys=("reward/mean", "loss/kl", "loss/entropy", "train/grad_norm"))
    assert two[STEPS]["loss/kl"] > 0                 # the reference rank on the other node did its part
