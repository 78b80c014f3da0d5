"""``model.tables``: embedding tables declared one by one, as TorchRec declares them.

Each entry has TorchRec's ``EmbeddingBagConfig`` field names (``name``, ``num_embeddings``,
``embedding_dim``, ``feature_names``, ``pooling``) plus ps_train's ``kind``:

- ``fixed``: ``num_embeddings`` rows, split by rows over the servers (``model.table_sharding``);
- ``dynamic``: rows keyed by raw 64-bit ids, created on first use (after ``admit_after``
  sightings) in ``max_rows`` preallocated slots per server, evicted by ``eviction``
  (``lru``, or ``ttl`` after ``ttl_steps`` unused steps, then LRU) -- Monolith's
  collisionless tables (``ps_train.workloads.ctr.tables.dynamic``). ``num_embeddings`` is then only the
  initialisation's scale (rows start uniform in +-sqrt(1 / num_embeddings)) and, for
  ``data=synthetic_ctr``, how many distinct ids the data draws.

A non-empty ``model.tables`` declares the tables: ``Config`` copies their sizes into
``data.table_sizes`` / ``data.num_tables`` and their poolings and feature names into
``model.pooling`` / ``model.feature_names`` (``apply_table_declarations``), so the rest of
ps_train reads them where it always has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ps_train.config.base import Problems

__all__ = ["TableConfig", "TABLE_KINDS", "EVICTIONS"]

TABLE_KINDS = ("fixed", "dynamic")
EVICTIONS = ("lru", "ttl")
_POOLINGS = ("sum", "mean")


@dataclass
class TableConfig:
    """One embedding table (an entry of ``model.tables``)."""

    name: str = ""  # the table's name (TorchRec's EmbeddingBagConfig.name), unique
    num_embeddings: int = 0  # fixed: rows; dynamic: the initialisation's scale (and synthetic data's distinct ids)
    embedding_dim: int | None = None  # must equal model.embedding_dim (null: that)
    feature_names: list[str] = field(default_factory=list)  # exactly one here; []: the table's name
    pooling: str = "sum"  # sum | mean
    kind: str = "fixed"  # fixed | dynamic
    max_rows: int | None = None  # dynamic: row slots per server (the cap)
    admit_after: int = 1  # dynamic: a row is created once its id was seen this many times
    eviction: str = "lru"  # dynamic: lru | ttl (rows unused for ttl_steps steps go first)
    ttl_steps: int | None = None  # dynamic with eviction=ttl

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"

    def feature(self) -> str:
        """The feature whose ids this table looks up (KeyedJagged key)."""
        return self.feature_names[0] if self.feature_names else self.name

    def problems(self, where: str, embedding_dim: int) -> Problems:
        """Problems of this entry; ``where`` names it in messages (``model.tables[2]``)."""
        p = Problems()
        p.need(bool(self.name), f"{where}.name: every table needs a name (TorchRec's EmbeddingBagConfig.name)")
        p.need(
            self.num_embeddings >= 2,
            f"{where}.num_embeddings: {self.num_embeddings} must be >= 2 (a dynamic table's: the ids' "
            "range for synthetic data and the initialisation's scale)",
        )
        p.need(
            self.embedding_dim is None or self.embedding_dim == embedding_dim,
            f"{where}.embedding_dim: {self.embedding_dim}, but every table row is model.embedding_dim="
            f"{embedding_dim} wide (the interaction needs one width); set it to {embedding_dim} or null",
        )
        p.need(
            len(self.feature_names) <= 1,
            f"{where}.feature_names: {self.feature_names}: ps_train gives each table one feature; declare "
            "one table per feature (or [] for the table's name)",
        )
        p.need(self.pooling in _POOLINGS, f"{where}.pooling: unknown {self.pooling!r}; choose one of {list(_POOLINGS)}")
        p.need(self.kind in TABLE_KINDS, f"{where}.kind: unknown {self.kind!r}; choose one of {list(TABLE_KINDS)}")
        if not self.dynamic:
            for key, value, default in (
                ("max_rows", self.max_rows, None),
                ("admit_after", self.admit_after, 1),
                ("eviction", self.eviction, "lru"),
                ("ttl_steps", self.ttl_steps, None),
            ):
                p.need(
                    value == default,
                    f"{where}.{key}: only dynamic tables take it; drop it or set {where}.kind=dynamic",
                )
            return p
        p.need(
            self.max_rows is not None and self.max_rows >= 1,
            f"{where}.max_rows: a dynamic table needs its row slots per server (the cap), >= 1; got {self.max_rows}",
        )
        p.need(self.admit_after >= 1, f"{where}.admit_after: {self.admit_after} must be >= 1 (1: every id at once)")
        p.need(
            self.eviction in EVICTIONS, f"{where}.eviction: unknown {self.eviction!r}; choose one of {list(EVICTIONS)}"
        )
        if self.eviction == "ttl":
            p.need(
                self.ttl_steps is not None and self.ttl_steps >= 1,
                f"{where}.ttl_steps: eviction=ttl needs the steps a row may stay unused, >= 1; got {self.ttl_steps}",
            )
        else:
            p.need(
                self.ttl_steps is None,
                f"{where}.ttl_steps: only eviction=ttl takes it; drop it or set {where}.eviction=ttl",
            )
        return p
