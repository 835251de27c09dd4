"""A keeper's parity: chunks folded into its shared-memory region (tier-1 XOR of its node's
workers, tier-2 contributions of other nodes), the pre-images an interval needs, and which
steps are complete here (docs/protection.md)."""

from __future__ import annotations

import numpy as np

from leto.protection.codec import words, xor_into
from leto.protection.layout import Layout
from leto.protection.shm import KIND_DELTA, Region


class Parity:
    """The parity of one node's region in one generation."""

    def __init__(self, region: Region, layout: Layout, node: int) -> None:
        self.region, self.layout = region, layout
        self.W = len(layout.local_ranks(node))
        self.interval = layout.protect_every > 1  # docs/protection.md, "Protection interval"
        self.stripes = {s.index: (s, j) for s, j in layout.parity_stripes(node)}  # the stripes it holds parity of
        self.expected, self.real = self._expected_counts()
        # the delta path's rows and tables, looked up once: a fold is one XOR and two stores
        self._p1, self._crc1, self._v1 = [words(row) for row in region["p1"]], region["crc1"], region["v1"]
        self._p2 = {si: [words(row) for row in region[f"p2_{si}"]] for si in self.stripes}
        self._crc2 = {si: region[f"crc2_{si}"] for si in self.stripes}
        self._v2 = {si: region[f"v2_{si}"] for si in self.stripes}
        # how many source chunks (tier-1 ones, and tier-2 ones that are real) are at each version:
        # `applied_step` is its lowest key, kept up to date by the folds instead of a scan of the tables
        self._real2 = {key: mask.tolist() for key, mask in self.real.items()}
        self._at: dict[int, int] = {}
        for v in self._v1.ravel().tolist():
            self._count(v, 1)
        for (si, p), real in self.real.items():
            for v in self._v2[si][p][real].tolist():
                self._count(v, 1)

    def _expected_counts(self) -> tuple[dict[int, np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """Per parity stripe: contributions expected at each offset, and which offsets of each
        data position hold real chunks (not padding)."""
        L = self.layout.segment_len
        expected, real = {}, {}
        for si, (s, _) in self.stripes.items():
            cnt = np.zeros(L, dtype=np.int64)
            for p, dn in enumerate(s.data_nodes):
                node, seg = self.layout.nodes[dn], s.segment_of(dn)
                mask = np.array([self.layout.source_of(node, seg * L + i) is not None for i in range(L)], dtype=bool)
                real[(si, p)] = mask
                cnt += mask
            expected[si] = cnt
        return expected, real

    def fold_local(self, kind: int, step: int, w: int, chunk: int, crc: int, payload: np.ndarray) -> None:
        """Fold worker `w`'s chunk into the tier-1 parity."""
        r = self.region
        if kind == KIND_DELTA:
            if self.interval:
                self._keep_preimage("p1", "crc1", self._v1[:, chunk], chunk, step)
            row = self._p1[chunk]
            np.bitwise_xor(row, words(payload), out=row)
            self._crc1[w, chunk] = crc
            self._moved(self._v1, (w, chunk), step)
            return
        b = step % 2
        if r["g1_step"][b, chunk] != step:
            r["g1"][b, chunk][...] = payload
            r["g1_step"][b, chunk] = step
            r["g1_count"][b, chunk] = 1
        else:
            xor_into(r["g1"][b, chunk], payload)
            r["g1_count"][b, chunk] += 1
        r["gcrc1"][w, b, chunk] = crc

    def fold_remote(self, kind: int, step: int, stripe: int, p: int, i: int, crc: int, body: np.ndarray) -> None:
        """Fold another node's contribution (data position `p`, offset `i`) into `stripe`'s parity."""
        r, v2, rows = self.region, self._v2[stripe], self._p2[stripe]
        if not (0 <= p < v2.shape[0] and 0 <= i < len(rows)):  # a peer's numbers: no wrap-around
            raise IndexError(f"no position {p}, offset {i} in stripe {stripe}")
        if kind == KIND_DELTA:
            if self.layout.tier2_preimages:
                real = [p for p in range(v2.shape[0]) if self.real[(stripe, p)][i]]
                self._keep_preimage(f"p2_{stripe}", f"crc2_{stripe}", v2[real, i], i, step)
            row = rows[i]
            if len(body) != row.nbytes:
                raise ValueError(f"a body of {len(body)} bytes for a parity row of {row.nbytes}")
            np.bitwise_xor(row, words(body), out=row)
            self._crc2[stripe][p, i] = crc
            if self._real2[(stripe, p)][i]:
                self._moved(v2, (p, i), step)
            else:  # padding: no source, so no version that counts
                v2[p, i] = step
            return
        b = step % 2
        if r[f"g2_step_{stripe}"][b, i] != step:
            r[f"g2_{stripe}"][b, i][...] = body
            r[f"g2_step_{stripe}"][b, i] = step
            r[f"g2_count_{stripe}"][b, i] = 1
        else:
            xor_into(r[f"g2_{stripe}"][b, i], body)
            r[f"g2_count_{stripe}"][b, i] += 1
        r[f"gcrc2_{stripe}"][p, b, i] = crc

    def _keep_preimage(self, parity: str, crc: str, versions: np.ndarray, i: int, step: int) -> None:
        """Before the first delta of a later protected step lands on parity row `i`, keep the
        row as it is while all its sources are at one step: recovery may have to decode at that
        step while the row is half-way to the next one."""
        r = self.region
        if versions.size and versions.min() == versions.max() < step:
            r[f"{parity}_pre"][i] = r[parity][i]
            r[f"{crc}_pre"][..., i] = r[crc][..., i]
            r[f"{parity}_pre_step"][i] = versions[0]

    def grads_complete(self, step: int) -> bool:
        r, b = self.region, step % 2
        if not (np.all(r["g1_step"][b] == step) and np.all(r["g1_count"][b] == self.W)):
            return False
        for si, exp in self.expected.items():
            real = exp > 0
            if not np.all(r[f"g2_step_{si}"][b][real] == step):
                return False
            if not np.all(r[f"g2_count_{si}"][b][real] == exp[real]):
                return False
        return True

    def deltas_complete(self, step: int) -> bool:
        return self.applied_step() >= step

    def applied_step(self) -> int:
        """The last step at which every source chunk's delta is folded here (lowest version)."""
        return min(self._at)

    def _count(self, version: int, n: int) -> None:
        left = self._at.get(version, 0) + n
        if left:
            self._at[version] = left
        else:
            del self._at[version]

    def _moved(self, table: np.ndarray, at: tuple[int, int], step: int) -> None:
        """Set a source chunk's version in `table` to `step`, and count it there."""
        self._count(int(table[at]), -1)
        table[at] = step
        self._count(step, 1)
