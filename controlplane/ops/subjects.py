"""`python -m controlplane.ops.subjects MODEL [--replica-id N] [--node ID]`: the subject filters an
operator gives the `nats` CLI for a model, a replica or a node (docs/nats-cli.md)."""

from __future__ import annotations

from schemas.subjects import operator_filters


def main(argv: list[str] | None = None) -> int:
    """`python -m schemas.subjects MODEL [--replica-id N] [--node ID]`: print the subject filters."""
    import argparse

    from schemas.keys import canonical_model_key

    p = argparse.ArgumentParser(prog="python -m schemas.subjects", description=main.__doc__)
    p.add_argument("model", nargs="?", help="repo id, checkpoint directory or NDIF model key")
    p.add_argument("--replica-id", type=int, help="one replica's subject")
    p.add_argument("--node", help="a node id: its event subject and heartbeat key")
    a = p.parse_args(argv)
    if a.model is None and a.node is None:
        p.error("give a MODEL, --node ID or both")
    mk = canonical_model_key(a.model) if a.model is not None else None
    if mk is not None:
        print(f"model key: {mk}")
    for what, subject in operator_filters(mk, a.replica_id, a.node).items():
        print(f"{what + ':':<18} {subject}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
