"""Two "nodes" on localhost: two `torchrun --nnodes 2` agents meet at one c10d rendezvous, as on a cluster
without SLURM. One node holds ranks 0 (the policy) and 1, the other ranks 2 and 3 (the reward); ranks 1-2 are the
reference, one FSDP group across the boundary. So token ids, rewards, reference logprobs and the reference's
all-gathers cross the node boundary every step."""

import socket
import sys

from conftest import FOUR_RANK_ARGS, FOUR_RANK_STEPS, REPO, assert_same_curve, grpo_args, read_metrics, script_env, \
    start, stop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grpo_across_two_nodes_equals_one_node(tiny, four_rank_run, tmp_path):
    args = grpo_args(tiny, tmp_path / "two_nodes", *FOUR_RANK_ARGS)
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

    two, one = read_metrics(tmp_path / "two_nodes"), read_metrics(four_rank_run)
    assert_same_curve(two, one, range(1, FOUR_RANK_STEPS + 1),
                      keys=("reward/mean", "loss/kl", "loss/entropy", "train/grad_norm"))
    assert two[FOUR_RANK_STEPS]["loss/kl"] > 0       # the reference ranks across the boundary did their part
