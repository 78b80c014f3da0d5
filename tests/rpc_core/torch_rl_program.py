"""The agent/observer structure of PyTorch's ``distributed/rpc/rl`` example (REINFORCE over
RPC), written against torch.distributed.rpc. test_torch_programs.py swaps its RPC import
lines for rpc_core's and runs both versions.

As in the example: the agent (rank 0) creates one ``Observer`` per other rank with
``remote``, keeps an ``RRef`` to itself, and starts each episode with ``rpc_async`` calls to
the observers' ``run_episode``; each observer calls back ``Agent.select_action`` and
``Agent.report_reward`` with ``rpc_sync``; the agent then updates its policy locally.
Differences: a small seeded environment with CartPole's interface instead of gym, a fixed
number of episodes, no argparse, and ``run_worker`` returns what the agent saw.
"""

import torch
import torch.distributed.rpc as rpc
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.rpc import RRef, remote, rpc_async, rpc_sync
from torch.distributions import Categorical

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
GAMMA = 0.99
SEED = 543
EPISODES = 4
STEPS_PER_EPISODE = 12


def _call_method(method, rref, *args, **kwargs):
    """Call ``method`` on the value the RRef holds (runs on its owner)."""
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    """Run ``method`` on the owner of ``rref`` and fetch the result."""
    args = [method, rref] + list(args)
    return rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class ToyPole:
    """CartPole's interface (reset/step -> state, reward, done, info) in a few lines: an
    angle and its velocity, pushed left or right by the action, with seeded noise."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.angle = self.velocity = 0.0

    def _state(self):
        return [self.angle, self.velocity, self.angle * self.velocity, 1.0]

    def reset(self):
        self.angle = float(torch.randn((), generator=self.g)) * 0.05
        self.velocity = 0.0
        return self._state()

    def step(self, action):
        push = 0.05 if action == 1 else -0.05
        self.velocity += push + 0.1 * self.angle + float(torch.randn((), generator=self.g)) * 0.01
        self.angle += self.velocity
        return self._state(), 1.0, abs(self.angle) > 0.5, {}


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, 2)

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


class Observer:
    """Owns one environment; asks the agent for actions and reports rewards."""

    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = ToyPole(SEED + self.id)

    def run_episode(self, agent_rref, n_steps):
        state = self.env.reset()
        for _ in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done, _ = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)
            if done:
                break


class Agent:
    def __init__(self, world_size):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=1e-2)
        self.eps = torch.finfo(torch.float32).eps
        self.running_reward = 0.0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        probs = self.policy(torch.tensor(state).unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps=0):
        futs = [
            rpc_async(ob_rref.owner(), _call_method, args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
            for ob_rref in self.ob_rrefs
        ]
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.extend(self.rewards[ob_id])
        min_reward = min(sum(self.rewards[ob_id]) for ob_id in self.rewards)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        steps = {ob_id: len(self.rewards[ob_id]) for ob_id in self.rewards}
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        policy_loss, returns = [], []
        for r in rewards[::-1]:
            R = r + GAMMA * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        for log_prob, R in zip(probs, returns, strict=True):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        torch.cat(policy_loss).sum().backward()
        self.optimizer.step()
        return min_reward, steps


def run_worker(rank, world_size):
    """Rank 0 is the agent, the others observers; MASTER_ADDR/MASTER_PORT come from the
    environment. The agent returns its per-episode results and final policy."""
    out = None
    if rank == 0:
        rpc.init_rpc(AGENT_NAME, rank=rank, world_size=world_size)
        torch.manual_seed(SEED)
        agent = Agent(world_size)
        episodes = []
        for _ in range(EPISODES):
            agent.run_episode(n_steps=STEPS_PER_EPISODE)
            last_reward, steps = agent.finish_episode()
            episodes.append({"min_reward": last_reward, "running_reward": agent.running_reward, "steps": steps})
        out = {"episodes": episodes, "policy": {k: v.tolist() for k, v in agent.policy.state_dict().items()}}
    else:
        rpc.init_rpc(OBSERVER_NAME.format(rank), rank=rank, world_size=world_size)
    rpc.shutdown()
    return out
