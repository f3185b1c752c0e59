"""What the chapter's notebooks tabulate and draw: example sequences, the per-kind gradient table, the
surviving circuit of Algorithm 1 (table and graph), and the paper's quoted accuracies for comparison.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import torch

from ...tasks.blocklist import BlockListTask
from .measure import QUERY_TYPES


def example_table(tasks: Mapping[str, BlockListTask], n: int, seed: int) -> pd.DataFrame:
    rows = []
    for kind, task in tasks.items():
        s = task.sample(n, seed)
        for i in range(n):
            rows.append({"task": kind, "sequence | query -> target": task.describe(s, i),
                         "query chain": "rare" if s.is_rare[i] else ("canonical" if s.canonical[i] else "non-canonical"),
                         "first labels": " ".join(map(str, s.positions[i, :4].tolist()))})
    return pd.DataFrame(rows)


def type_gradient_table(per_kind: Mapping[tuple, torch.Tensor]) -> pd.DataFrame:
    """Norm of each kind's in-context gradient with delta = 0 and learned, relative to the canonical kind at delta = 0."""
    ref = float(per_kind[("canonical", "delta = 0")].norm())
    return pd.DataFrame([{"queried chain": kind, "delta = 0": float(per_kind[(kind, "delta = 0")].norm()) / ref,
                          "delta learned": float(per_kind[(kind, "delta learned")].norm()) / ref}
                         for kind in QUERY_TYPES])


PAPER_AIDING_ACCURACY = {"without aiding": 0.59, "with aiding": 0.92}  # IM-6 in PAPERS.md ("about"), for comparison


def survivors_table(result: dict, names: Sequence[str]) -> pd.DataFrame:
    alive, theta = result["alive"], result["theta"]
    idx = torch.nonzero(alive).squeeze(1).tolist()
    rows = [] if idx else pd.DataFrame(columns=["coordinate", "kind", "value", "aiding"])
    for i in idx:
        name = names[i]
        kind = "readout" if name.startswith("U|") else "key-query"
        rows.append({"coordinate": name, "kind": kind, "value": float(theta[i]),
                     "aiding": kind == "key-query" and float(theta[i]) < 0})
    return pd.DataFrame(rows) if idx else rows


def circuit_graph(table: pd.DataFrame, n_layers: int):
    """A networkx MultiDiGraph of the surviving circuit: nodes 'emb', 'L{l}H{h}', 'out'; an edge from the last
    head of each key and query path into the head whose coordinate survived, and from the last head of each
    readout path to 'out'. Edges between two nodes are merged per kind (key 'core' or 'aiding'), their label
    listing the side (q: query, k: key) and selection of every coordinate they carry."""
    import networkx as nx

    G = nx.MultiDiGraph()
    G.add_node("emb", layer=0)
    for l in range(1, n_layers + 1):
        G.add_node(f"L{l}H0", layer=l)
    G.add_node("out", layer=n_layers + 1)

    def last(path: str) -> str:
        return "emb" if path == "emb" else path.split(">")[-1]

    sides: dict[tuple, dict[str, list[str]]] = {}

    def add(src: str, dst: str, kind: str, side: str, sel: str) -> None:
        sides.setdefault((src, dst, kind), {}).setdefault(side, []).append(sel)

    for r in table.itertuples():
        parts = r.coordinate.split("|")
        kind = "aiding" if bool(r.aiding) else "core"
        if parts[0] == "U":
            add(last(parts[1]), "out", kind, "", parts[2])
            continue
        head, q, k, sel = parts
        add(last(q), head, kind, "q:", sel)
        add(last(k), head, kind, "k:", sel)
    for (src, dst, kind), by_side in sides.items():
        G.add_edge(src, dst, key=kind, label="; ".join(side + _compact(sels) for side, sels in by_side.items()),
                   aiding=kind == "aiding")
    return G


def _compact(selections: Sequence[str]) -> str:
    """['I', 'pos1', 'pos3', 'I'] -> 'I, pos1,3' (each selection once, shifts merged)."""
    tokens = list(dict.fromkeys(s for s in selections if not s.startswith("pos")))
    shifts = sorted({int(s[3:]) for s in selections if s.startswith("pos")})
    if shifts:
        tokens.append("pos" + ",".join(map(str, shifts)))
    return ", ".join(tokens)


def draw_circuit(ax, G) -> None:
    """Draw `circuit_graph`'s graph: nodes left to right by layer, edges as arcs under them labelled with
    their selections; aiding edges dashed red on deeper arcs."""
    import networkx as nx

    pos = {n: (d["layer"], 0.0) for n, d in G.nodes(data=True)}
    nx.draw_networkx_nodes(G, pos, ax=ax, node_color="#dddddd", node_size=1000)
    nx.draw_networkx_labels(G, pos, ax=ax, font_size=8)
    for kind, color, line, rad in (("core", "0.25", "solid", 0.3), ("aiding", "C3", "dashed", 0.55)):
        edges = [(u, v, k) for u, v, k in G.edges(keys=True) if k == kind]
        if not edges:
            continue
        style = f"arc3,rad={rad}"
        nx.draw_networkx_edges(G, pos, edgelist=edges, ax=ax, connectionstyle=style, arrows=True, style=line,
                               edge_color=color, node_size=1000, width=1.2)
        nx.draw_networkx_edge_labels(G, pos, edge_labels={e: G.edges[e]["label"] for e in edges}, ax=ax,
                                     connectionstyle=style, font_size=6, font_color=color,
                                     bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    span = max((abs(pos[v][0] - pos[u][0]) for u, v in G.edges()), default=1)
    ax.set_xlim(-0.5, max(x for x, _ in pos.values()) + 0.5)
    ax.set_ylim(-0.2 * span - 0.1, 0.2)
    ax.axis("off")

