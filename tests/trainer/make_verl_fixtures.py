"""Reference values for troupe's RL objectives, advantages and importance corrections, computed
by verl's own functions (verl 0.9.1 from PyPI, installed without its dependencies by the set-up).

verl's core_algos.py and rollout_corr_helper.py are loaded as files, with stand-ins for the
modules they import only for types or for functions these fixtures do not call (omegaconf,
tensordict, verl's config classes), so no GPU stack is needed. Every number is float64.

Usage: make_verl_fixtures.py OUT_DIR   (writes OUT_DIR/verl.json)
"""

import importlib.metadata
import importlib.util
import json
import pathlib
import sys
import types

import numpy as np
import torch

VERL_VERSION = "0.9.1"


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so that submodules can be stubbed below it
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


class ActorConfig(dict):
    """verl.workers.config.ActorConfig as the policy losses read it."""

    def __init__(self, low, high, **extra):
        super().__init__(clip_ratio_c=1e9, **extra)  # dual clip off: troupe has none
        self.clip_ratio = low
        self.clip_ratio_low = low
        self.clip_ratio_high = high
        self.global_batch_info = {}


class AlgoConfig(dict):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.__dict__.update(kw)


def load_verl():
    dist = importlib.metadata.distribution("verl")
    if dist.version != VERL_VERSION:
        sys.exit(f"make_verl_fixtures: verl {VERL_VERSION} expected, found {dist.version}")
    stub("omegaconf", DictConfig=dict)
    stub("tensordict", TensorDict=dict)
    stub("verl")
    stub("verl.utils", as_torch_index=None, group_mean_std=None)
    stub("verl.utils.device", get_device_name=lambda: "cpu", get_torch_device=lambda: torch.cpu)
    stub("verl.utils.import_utils", deprecated=lambda *a, **k: (lambda f: f))
    stub("verl.trainer")
    stub("verl.trainer.config", AlgoConfig=AlgoConfig)
    stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=object)
    stub("verl.workers")
    stub("verl.workers.config", ActorConfig=ActorConfig)
    stub("verl.workers.config.actor", PolicyLossConfig=object)
    stub("verl.protocol", DataProto=object)
    stub("verl.trainer.ppo")
    modules = {}
    for name, rel in [("verl.utils.torch_functional", "verl/utils/torch_functional.py"),
                      ("verl.trainer.ppo.core_algos", "verl/trainer/ppo/core_algos.py"),
                      ("verl.trainer.ppo.rollout_corr_helper", "verl/trainer/ppo/rollout_corr_helper.py")]:
        spec = importlib.util.spec_from_file_location(name, dist.locate_file(rel))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if name == "verl.utils.torch_functional":
            sys.modules["verl.utils"].torch_functional = module
        spec.loader.exec_module(module)
        modules[name.rsplit(".", 1)[1]] = module
    return modules["core_algos"], modules["rollout_corr_helper"]


def the_batch():
    """2 groups of 3 completions, up to 7 tokens, of different lengths (float64)."""
    g = torch.Generator().manual_seed(7)
    B, L = 6, 7
    lengths = torch.tensor([7, 5, 3, 6, 1, 4])
    mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).double()
    old = torch.randn(B, L, generator=g, dtype=torch.float64) * 0.5 - 1.5
    logp = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.6
    adv = torch.tensor([1.3, -0.4, -0.9, 0.7, -1.1, 0.2], dtype=torch.float64)
    return dict(mask=mask, old=old, logp=logp, rollout=rollout, adv=adv)


def policy_losses(core, corr, batch):
    mask, old, rollout = batch["mask"], batch["old"], batch["rollout"]
    adv = batch["adv"].unsqueeze(1) * mask
    weights = {
        "none": None,
        "token_truncate": corr.compute_rollout_correction_weights(old - rollout, mask, "token", 2.0)[0],
        "token_mask": corr.compute_rollout_correction_weights(old - rollout, mask, "token", "0.5_2.0")[0],
    }
    cases = []
    for objective, verl_name in [("grpo", "vanilla"), ("gspo", "gspo"), ("cispo", "cispo")]:
        fn = core.get_policy_loss_fn(verl_name)
        for aggregation, verl_agg in [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                                      ("dr_grpo", "seq-mean-token-sum-norm")]:
            for correction, w in weights.items():
                logp = batch["logp"].clone().requires_grad_(True)
                loss, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                             loss_agg_mode=verl_agg, config=ActorConfig(0.2, 0.28), rollout_is_weights=w)
                loss.backward()
                cases.append(dict(objective=objective, aggregation=aggregation, correction=correction,
                                  loss=loss.item(), grad=logp.grad.tolist()))
    return cases, {k: v.tolist() for k, v in weights.items() if v is not None}


def advantages(core):
    """3 groups of 4 rewards, one group tied; completion lengths for the token-weighted ones."""
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0], [0.2, 0.9, 0.0, 0.4]], dtype=torch.float64)
    lengths = torch.tensor([[3, 5, 2, 6], [4, 1, 3, 2], [5, 5, 2, 7]])
    N, G = rewards.shape
    T = int(lengths.max())
    mask = (torch.arange(T).unsqueeze(0) < lengths.reshape(-1, 1)).double()
    token_rewards = torch.zeros(N * G, T, dtype=torch.float64)
    token_rewards[torch.arange(N * G), lengths.reshape(-1) - 1] = rewards.reshape(-1)  # the outcome on the last token
    index = np.repeat(np.arange(N), G)
    algo = AlgoConfig(gamma=1.0)
    out = {}
    calls = {
        "group": lambda: core.compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6),
        "group_none": lambda: core.compute_grpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=False),
        "rloo": lambda: core.compute_rloo_outcome_advantage(token_rewards, mask, index),
        "reinforce_pp": lambda: core.compute_reinforce_plus_plus_outcome_advantage(token_rewards, mask, config=algo),
        "reinforce_pp_baseline": lambda: core.compute_reinforce_plus_plus_baseline_outcome_advantage(
            token_rewards, mask, index),
    }
    for name, call in calls.items():
        adv, _ = call()
        # Outcome rewards with gamma 1: one value over each completion's tokens.
        per_token = adv.reshape(N, G, T)
        first = per_token[..., 0]
        spread = ((per_token - first.unsqueeze(-1)) * mask.reshape(N, G, T)).abs().max().item()
        assert spread < 1e-12, f"{name}: advantages vary within a completion ({spread})"
        out[name] = first.tolist()
    return dict(rewards=rewards.tolist(), lengths=lengths.tolist(), values=out)


def gae(core):
    """PPO's GAE on per-token rewards and values."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 3, 4])
    B, L = 3, 5
    mask = (torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)).double()
    rewards = torch.randn(B, L, generator=g, dtype=torch.float64) * mask
    values = torch.randn(B, L, generator=g, dtype=torch.float64) * mask
    adv, returns = core.compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.95)
    # verl whitens the advantages inside; the raw ones are returns - values.
    return dict(mask=mask.tolist(), rewards=rewards.tolist(), values=values.tolist(), gamma=0.99, lam=0.95,
                returns=returns.tolist(), whitened=adv.tolist())


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    core, corr = load_verl()
    batch = the_batch()
    cases, weights = policy_losses(core, corr, batch)
    fixture = dict(verl=VERL_VERSION, epsilon=0.2, epsilon_high=0.28, token_truncate_high=2.0, token_mask=[0.5, 2.0],
                   batch={k: v.tolist() for k, v in batch.items()}, policy_losses=cases, weights=weights,
                   advantages=advantages(core), gae=gae(core))
    (out / "verl.json").write_text(json.dumps(fixture))
    print(f"make_verl_fixtures: {len(cases)} policy-loss cases, 5 advantage estimators and GAE from verl {VERL_VERSION}")


if __name__ == "__main__":
    main()
