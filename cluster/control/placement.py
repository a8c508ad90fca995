"""Whether the cluster can hold a service's engines at all, decided before any is placed.

Ray waits for a placement group it cannot place (an autoscaler may add nodes), so an engine
asking for what the cluster does not have would otherwise be found out only at a timeout.
`check_placeable` packs every engine's bundles onto the nodes' total resources, first fit,
following each engine's placement strategy, in the order the Coordinator starts them and
largest first; when neither fits, the first engine that did not is refused with what it asked
for and what the nodes have. It is a
check against an empty cluster: it says "never", not "now" (the Coordinator still waits, up to
`placement_timeout_s`, for resources that are there but taken).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Bundle = Mapping[str, float]


class Unplaceable(RuntimeError):
    """No node assignment of the cluster as it stands holds the engine."""


def check_placeable(
    demand: Mapping[str, Sequence[Bundle]],
    strategies: Mapping[str, str],
    nodes: Mapping[str, Bundle],
) -> None:
    """`demand`: engine -> one bundle per rank; `strategies`: engine -> placement strategy
    (engines of one rank: any); `nodes`: node -> total resources. Raises Unplaceable naming
    the first engine that cannot be placed, with what it asks and what the nodes have."""

    # First fit can fail where another order fits (a small engine on the one big node): the
    # largest engines first is tried too. Refused only when neither order fits.
    def size(engine: str) -> tuple[float, float]:
        bundles = demand[engine]
        return (
            sum(b.get("GPU", 0.0) for b in bundles),
            sum(sum(b.values()) for b in bundles),
        )

    orders = [list(demand), sorted(demand, key=size, reverse=True)]
    refusals = [_pack(order, demand, strategies, nodes) for order in orders]
    if all(refusals):
        raise Unplaceable(refusals[0])


def _pack(
    order: Sequence[str],
    demand: Mapping[str, Sequence[Bundle]],
    strategies: Mapping[str, str],
    nodes: Mapping[str, Bundle],
) -> str | None:
    """Why packing the engines in `order` fails (None: it fits)."""
    free = {node: dict(resources) for node, resources in nodes.items()}
    for engine in order:
        bundles = demand[engine]
        strategy = strategies.get(engine, "PACK")
        placed = _place(bundles, strategy, free)
        if placed is None:
            return _message(engine, bundles, strategy, nodes, free)
        for node, bundle in placed:
            for name, amount in bundle.items():
                free[node][name] = free[node].get(name, 0.0) - amount
    return None


def _fits(bundle: Bundle, resources: Mapping[str, float]) -> bool:
    return all(resources.get(name, 0.0) >= amount - 1e-9 for name, amount in bundle.items())


def _place(
    bundles: Sequence[Bundle], strategy: str, free: Mapping[str, Mapping[str, float]]
) -> list[tuple[str, Bundle]] | None:
    """Where each bundle goes (first fit), or None."""
    if strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for bundle in bundles:
            for name, amount in bundle.items():
                total[name] = total.get(name, 0.0) + amount
        node = next((n for n, resources in free.items() if _fits(total, resources)), None)
        return None if node is None else [(node, bundle) for bundle in bundles]
    left = {node: dict(resources) for node, resources in free.items()}
    placed: list[tuple[str, Bundle]] = []
    for bundle in bundles:
        if not any(bundle.values()):  # takes nothing: an engine of one rank with num_cpus=0
            continue
        used = {node for node, _ in placed}
        candidates = [n for n in left if not (strategy == "STRICT_SPREAD" and n in used)]
        node = next((n for n in candidates if _fits(bundle, left[n])), None)
        if node is None:
            return None
        placed.append((node, bundle))
        for name, amount in bundle.items():
            left[node][name] = left[node].get(name, 0.0) - amount
    return placed


def _message(
    engine: str,
    bundles: Sequence[Bundle],
    strategy: str,
    nodes: Mapping[str, Bundle],
    free: Mapping[str, Mapping[str, float]],
) -> str:
    def show(resources: Mapping[str, float]) -> str:
        kept = {k: round(v, 3) for k, v in sorted(resources.items()) if k in ("CPU", "GPU")}
        kept |= {k: round(v, 3) for k, v in sorted(resources.items()) if k in _asked(bundles)}
        return str(kept)

    asked = f"{len(bundles)} bundle{'s' if len(bundles) > 1 else ''} of {dict(bundles[0])}"
    how = f" ({strategy})" if len(bundles) > 1 else ""
    has = "; ".join(
        f"{node}: {show(nodes[node])}, {show(free[node])} left by the engines before it"
        for node in nodes
    )
    return (
        f"engine {engine} asks for {asked}{how}, which this cluster cannot hold even empty "
        f"(nodes: {has or 'none'}); add nodes with those resources, or lower "
        "tensor_parallel_size / rank_resources / engine_actor_options"
    )


def _asked(bundles: Sequence[Bundle]) -> set[str]:
    return {name for bundle in bundles for name in bundle}
