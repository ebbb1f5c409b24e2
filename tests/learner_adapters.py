"""A user's adapter as the learner publishes it, with weights a test chooses instead of trained ones.

Export and engine checks need an adapter with the learner's own LoRA config (rank, alpha, every
projection) and layout on disk, which moves the model visibly: the learner's fresh lora_B is zero,
and training one takes minutes on a real model. So its LoRA weights are drawn at random.
"""

from __future__ import annotations

from pathlib import Path

from nextstate.core.settings import Settings


def publish_random_adapter(data_dir: Path, model_dir: Path, user: str = "alice", std: float = 0.05,
                           seed: int = 3) -> Settings:
    """Publish v1 of `user`'s own adapter into `data_dir`, its LoRA weights drawn from N(0, std²);
    the settings that find it (per-user scopes), for `nextstate.export.build_export`."""
    import torch

    from nextstate.learner.trainer import LoraTrainer
    from nextstate.learner.versions import AdapterVersions

    settings = Settings(data_dir=data_dir, model=str(model_dir), adapter_scope="user")
    trainer = LoraTrainer(model_dir, settings.learner)
    torch.manual_seed(seed)
    for param in trainer._params(trainer.ensure_scope(user)):
        param.data.normal_(0.0, std)
    AdapterVersions(settings.adapters_dir).publish(user, 1, lambda path: trainer.save(user, path), {})
    return settings
