"""Starting the worker actors (`workers.actors`) with their placement, from a replica or `specserve serve`: this
module imports no model code (the actor classes are imported where they are started), so the processes that only
start or adopt workers do not pay for it."""

from __future__ import annotations

from typing import Any

from specserve.workers.config import DEFAULT_KV_TOKENS, RoleResources, WorkersConfig


def describe_model(spec: Any) -> dict[str, Any]:
    """vocab, eos ids, context and name from a model's config files, without loading its weights."""
    from transformers import AutoConfig, GenerationConfig

    from specserve.models.drafts import configs  # noqa: F401 - registers the drafts' configs
    from specserve.models.formats.loading import resolve_model_path

    path, name = resolve_model_path(spec)
    config = AutoConfig.from_pretrained(str(path))
    eos: set[int] = set()
    sources = [config]
    try:
        sources.append(GenerationConfig.from_pretrained(str(path)))
    except OSError:
        pass
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            eos.update(value if isinstance(value, list) else [value])
    return {"vocab": int(config.vocab_size), "eos_ids": sorted(eos), "name": name, "dtype": None, "device": None,
            "max_positions": getattr(config, "max_position_embeddings", None),
            "num_layers": int(config.num_hidden_layers)}


def start_workers(config: WorkersConfig, target: Any = None, draft: Any = None, gamma_max: int = 8,
                  token: str | None = None):
    """Create the target and draft actors with the configured placement; returns (target, draft | None).
    token: the secret their gRPC services demand of callers (`rpc.auth`; None: none).

    `target`/`draft` override the config's model specs (tests pass loaded tiny models). The n-gram
    draft gets no actor unless `config.ngram_worker`: the coordinator drafts it from the tokens it holds.
    """
    import ray

    from specserve.workers.actors import DraftWorkerActor

    target_spec = config.target if target is None else target
    served_name = getattr(config, "model_name", None)  # the workers' metrics carry the model id clients see
    draft_spec = config.draft if draft is None else draft
    stages, groups = None, []
    if config.target_stages:
        from specserve.workers.ranks import check_model
        from specserve.workers.stages import start_stages

        layers = describe_model(target_spec)["num_layers"]
        for i, stage in enumerate(config.target_stages):
            if stage.tensor_parallel > 1:
                check_model(target_spec, stage.tensor_parallel, f"target_stages[{i}].tensor_parallel")
        stages, groups = start_stages(target_spec, config.dtype, config.quantization, config.target_stages, layers,
                                      config.fixed_kv_tokens())
    colocated = draft_spec if config.colocated(draft_spec) else None
    resources, placement = config.target_resources, {}
    if resources.tensor_parallel > 1:
        from specserve.workers.ranks import check_model

        check_model(target_spec, resources.tensor_parallel, "target_resources.tensor_parallel")
        placement = {"scheduling_strategy": _rank_group(resources)}
    target_actor = _target_actor(config, target_spec, stages, colocated, gamma_max, token, placement)
    if placement:
        groups.append(placement["scheduling_strategy"].placement_group)
    if groups:
        _RANK_GROUPS[target_actor._actor_id.hex()] = groups
    info = ray.get(target_actor.info.remote())
    vocab = info["vocab"]
    draft_actor = None
    if config.has_draft_worker(draft_spec) and colocated is None:
        draft_actor = _remote(DraftWorkerActor, config.draft_resources, config.max_restarts).remote(
            draft_spec, vocab, config.dtype, config.draft_top_k, config.draft_resources.threads(),
            config.kv_cache_tokens or info.get("kv_cache_tokens") or DEFAULT_KV_TOKENS, config.session_idle_s, token,
            config.draft_quantization, config.prefix_caching,
            served_name=served_name,
        )
    return target_actor, draft_actor


def _target_actor(config: WorkersConfig, target_spec: Any, stages, colocated, gamma_max: int, token: str | None,
                  placement: dict, **named):
    from specserve.workers.actors import TargetWorkerActor

    resources = config.target_resources
    return _remote(TargetWorkerActor, resources, config.max_restarts, **placement, **named).remote(
        target_spec, config.dtype, resources.threads(), stages, config.scheduling(), colocated, gamma_max,
        config.draft_top_k, config.session_idle_s, token, config.quantization, config.draft_quantization,
        resources.tensor_parallel, resources.actor_options(), served_name=getattr(config, "model_name", None),
    )


PRESTART_NAMESPACE = "specserve"


def can_prestart(config: WorkersConfig) -> bool:
    """Whether `prestart_target` applies: the whole target in one worker (no ranks, no stages) and no draft
    worker of its own (the draft colocated, prompt lookup or none)."""
    return (config.target_resources.tensor_parallel == 1 and not config.target_stages
            and not config.has_draft_worker())


def prestart_target(config: WorkersConfig, gamma_max: int, name: str):
    """The target worker started ahead of the replica that will use it, as the named actor `name` (its owner the
    caller: `specserve serve` starts it beside Serve's own start, so the model loads meanwhile); the replica adopts
    it (`adopt_target`). Only where `can_prestart`."""
    import secrets

    draft = config.draft if config.colocated() else None
    return _target_actor(config, config.target, None, draft, gamma_max, secrets.token_urlsafe(24), {}, name=name,
                         namespace=PRESTART_NAMESPACE)


def adopt_target(name: str):
    """(the target worker `prestart_target` started as `name`, its gRPC token), or None where there is none (it
    failed to start: the caller starts its own, which says why)."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=PRESTART_NAMESPACE)
        return actor, ray.get(actor.worker_token.remote())
    except (ValueError, ray.exceptions.RayActorError):
        return None


_RANK_GROUPS: dict[str, list] = {}  # tensor-parallel groups' placement groups, by the target actor's id


def release_workers(target_actor) -> None:
    """Give back what `start_workers` reserved beside the actors themselves (a tensor-parallel target's placement
    group; removing it ends the ranks in it). The owner of the actors calls this when it shuts down; an owner that
    dies without shutting down (a crashed Serve replica, a detached actor) takes its group with it (Ray's)."""
    import ray

    for group in _RANK_GROUPS.pop(target_actor._actor_id.hex(), []):
        ray.util.remove_placement_group(group)


def _rank_group(resources: RoleResources, timeout_s: float = 600.0, field: str = "target_resources.tensor_parallel"):
    """A placement group of one bundle per tensor-parallel rank, on one node; the strategy that puts an actor
    in its first bundle (rank 0). Fails naming the resources when Ray cannot find such a node in time."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = [resources.bundle() for _ in range(resources.tensor_parallel)]
    group = placement_group(bundles, strategy="STRICT_PACK", name="")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"{field}: no node has {len(bundles)} x {bundles[0]} free "
                           f"(waited {timeout_s:.0f} s)")
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)


def _remote(cls, resources: RoleResources, max_restarts: int = 0, **placement):
    """A worker actor class placed as `resources` say (or in a placement group's bundle, which carries them);
    Ray restarts its process up to max_restarts times (its replacement runs __init__ again: loads the model,
    serves on a new port)."""
    import ray

    options = resources.actor_options()
    if placement:
        options.pop("accelerator_type", None)
    return ray.remote(cls).options(**options, **placement, max_restarts=max_restarts)


def _node_ip() -> str:
    """The address a worker serves on: its Ray node's (the coordinator may be on another node), or loopback
    outside Ray."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
