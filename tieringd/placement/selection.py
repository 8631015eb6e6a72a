# SPDX-License-Identifier: Apache-2.0
"""Step 6 of a policy tick: from each block's target tier to this tick's moves.

Within the tick's migration budget: promotions first (hottest first), then prefetches, then demotions
(coldest first, from tiers under pressure first). A promotion into a tier above its high watermark is
paired with demotions out of it; no tier's inflow ever exceeds its free capacity, whatever order the
mover runs the moves in. Demotions not paired with a promotion take a tier under pressure down to its
low watermark once this tick's promotions have landed, and no further (:meth:`MoveSelection._shed_bytes`).
Moves of adjacent blocks to the same node coalesce into one address range.

:class:`MoveSelection` is a part of :class:`tieringd.placement.policy.Policy` (the attributes it reads,
``cfg``, ``tiers``, ``tier_values`` and the scratch buffers, are the policy's).
"""
from __future__ import annotations

import numpy as np

from tieringd.contracts import Move, Priority, Tier
from tieringd.placement.heat import BlockTable
from tieringd.placement.plan import Marks, Plan, TickState, fitting_prefix, ordered_prefix


class MoveSelection:
    def _moves(self, table: BlockTable, st: TickState, budget_bytes: float) -> Plan:
        """The moves of the plan that fit ``budget_bytes``, promotions first."""
        M = len(self.tiers)
        marks = Marks(self._buf("mark", st.n, np.bool_, zeroed=True))
        differs, _ = self._masks(st.n)
        np.not_equal(st.tier_target, st.tier_now, out=differs)
        moving = np.flatnonzero(differs)
        to_k, from_k, sizes = st.tier_target[moving], st.tier_now[moving], st.sizes[moving]
        flow = np.bincount(to_k * np.uint8(M) + from_k, weights=sizes, minlength=M * M).reshape(M, M)
        planned = st.used_bytes + flow.sum(axis=1) - flow.sum(axis=0)      # rows: to, columns: from
        promos, prefetches, downs = self._move_candidates(st, moving, to_k, from_k, sizes, budget_bytes, marks)
        room_bytes = st.capacity_bytes - st.used_bytes                     # hard: inflow never exceeds this
        free_bytes = np.maximum(self.cfg.high_watermark * st.capacity_bytes - st.used_bytes, 0.0)
        # under pressure, promotions leave a share of the budget to demotions
        reserve = self.cfg.demotion_reserve * budget_bytes if st.pressure.any() and len(downs) else 0.0
        chosen, paired, left, deferred = self._promotions(st, promos, prefetches, downs, budget_bytes - reserve,
                                                          room_bytes, free_bytes, marks)
        shed = self._shed_bytes(st, chosen, paired, deferred)
        chosen += self._demotions(st, downs, paired, left + reserve, room_bytes, marks, shed)
        return self._to_plan(table, st, chosen, planned, float(flow.sum()), budget_bytes)

    def _shed_bytes(self, st: TickState, chosen, paired: list[np.ndarray], deferred: np.ndarray) -> np.ndarray:
        """Per tier, the bytes its unpaired demotions may take out this tick (with
        ``demote_only_under_pressure``; without it, unlimited: the budget decides), counted after this
        tick's promotions and paired demotions have run:

        - under pressure, down to the low watermark and no further;
        - without pressure, only what lets the next promotion its room held back land next tick:
          nothing while the gap above the high watermark holds a block, else a full tier (a high
          watermark of 1) would never let one in.

        The plan's demotions assume every planned promotion lands this tick; those the tier's room
        defers must not empty it in advance: the simulator's generated trace at 5 % of DRAM under a
        sampled signal sank to 166 of 204 blocks between ticks, demoting blocks read again at once
        (2 points of hit rate behind transparent LRU, whose shadow sheds only to its low
        watermark)."""
        if not self.cfg.demote_only_under_pressure:
            return np.full(len(self.tiers), np.inf)
        after = st.used_bytes.copy()
        moved = [b for b, _ in chosen] + paired
        if moved:
            blocks = np.concatenate(moved)
            M, sizes = len(self.tiers), st.sizes[blocks]
            after += np.bincount(st.tier_target[blocks], weights=sizes, minlength=M)[:M]
            after -= np.bincount(st.tier_now[blocks], weights=sizes, minlength=M)[:M]
        low = self.cfg.low_watermark * st.capacity_bytes
        room_after = st.capacity_bytes - after
        return np.where(st.pressure, np.maximum(after - low, 0.0), np.maximum(deferred - room_after, 0.0))

    def _move_candidates(self, st: TickState, moving: np.ndarray, to_k: np.ndarray, from_k: np.ndarray,
                         sizes: np.ndarray, budget_bytes: float, marks: Marks):
        """Only a budget's worth can move this tick: narrow the candidates first, in one histogram
        over (group, rank): promotions grouped by destination tier, hottest first; demotions by
        source tier, coldest first. Prefetches (a few per sequential region) are taken as they come.
        ``to_k``/``from_k``/``sizes``: the moving blocks' target and current tier and bytes. Returns
        (promotions, prefetches, (demotions, their source tier))."""
        M = len(self.tiers)
        top = st.fixed_key                        # movable keys are below it; cold-first ranks: top − 1 − key
        if len(st.prefetch):
            prefetches = st.prefetch[st.tier_target[st.prefetch] < st.tier_now[st.prefetch]]
            is_prefetch = marks.isin(moving, prefetches)
        else:
            prefetches, is_prefetch = st.prefetch, None
        key = st.rank_key[moving]
        up = to_k < from_k
        group = np.where(up, to_k, from_k + np.uint8(M))                # uint8: 2·M groups
        rank = top * group.astype(np.intp)
        rank += key                                 # group-major, hottest first within a group
        if is_prefetch is not None:
            rank[is_prefetch] = 2 * M * top                 # outside every group: never a head
        hist = np.bincount(rank, weights=sizes, minlength=2 * M * top + 1)[:2 * M * top].reshape(2 * M, top)
        # Per rank, from the histogram: −1 wholly within its group's budget, 0 the bucket where the
        # budget runs out, 1 beyond. Promotions take the hottest first, demotions the coldest (their
        # rows are read backwards). One gather through this table marks every candidate.
        state = np.ones(2 * M * top + 1, np.int8)
        edge_left_bytes: dict[int, float] = {}
        for g in range(2 * M):
            row, h = state[g * top:(g + 1) * top], hist[g]
            if g >= M:
                row, h = row[::-1], h[::-1]
            cs = np.cumsum(h)
            at = int(np.searchsorted(cs, budget_bytes, side="left"))
            row[:at] = -1
            if at < top:
                row[at] = 0
                edge_left_bytes[g] = budget_bytes - (float(cs[at - 1]) if at else 0.0)
        mark = np.take(state, rank)
        head = np.flatnonzero(mark <= 0)
        at_edge = mark[head] == 0
        edge = head[at_edge]
        heads = [head[~at_edge]]
        # The bucket where a group's budget runs out can hold millions of tied blocks (idle blocks
        # all have the heat of their static factors): take from it only the budget's worth (and one
        # block more), in the tie order — equal rank: promote the newer block first, demote the
        # older one first (as the fill splits).
        edge_group = group[edge]
        for g, left_bytes in edge_left_bytes.items():
            members = edge[edge_group == g]
            if g < M:
                members = members[::-1]
            r, _ = fitting_prefix(members, sizes, left_bytes)
            heads.append(members[:r + 1])
        head = np.concatenate(heads)
        head_key = key[head]
        order = np.where(up[head], head_key, (top - 1) - head_key) + top * group[head].astype(np.intp)
        head = head[np.lexsort((np.where(up[head], -head, head), order))]
        head_up = up[head]
        return moving[head[head_up]], prefetches, (moving[head[~head_up]], from_k[head[~head_up]])

    def _promotions(self, st: TickState, promos, prefetches, downs, left: float, room_bytes, free_bytes,
                    marks: Marks):
        """Promotions, then prefetches, per destination tier (fastest first), each while the budget
        lasts and the tier has room; past a tier's high watermark a promotion takes the coldest
        demotions out of it along (paired). Updates room/free in place. Returns (chosen, paired, left,
        deferred: per tier, the size of the next promotion into it that its room alone held back)."""
        down, down_from = downs
        chosen: list[tuple[np.ndarray, int]] = []          # (blocks, priority)
        paired: list[np.ndarray] = []                       # demotions that make room for promotions
        deferred = np.zeros(len(self.tiers))
        for prio, ups in ((Priority.PROMOTE, promos), (Priority.PREFETCH, prefetches)):
            ups_to = st.tier_target[ups]
            for k in range(len(self.tiers)):
                if left <= 0:
                    break
                # promotions are hottest first; prefetches keep candidate order (nearest the cursor first)
                cand = ups[ups_to == k]
                if len(cand) == 0:
                    continue
                inflow = np.cumsum(st.sizes[cand])
                out_k = down[down_from == k]                # coldest first
                if paired:
                    out_k = out_k[~marks.isin(out_k, np.concatenate(paired))]
                outflow = np.cumsum(st.sizes[out_k])
                need_out = np.maximum(inflow - free_bytes[k], 0.0)     # bytes that need a demotion out of k
                j = np.searchsorted(outflow, need_out, side="left")
                if len(outflow):
                    pay = np.where(need_out > 0, outflow[np.minimum(j, len(outflow) - 1)], 0.0)
                else:
                    pay = np.where(need_out > 0, np.inf, 0.0)
                ok = (inflow + pay <= left) & (inflow <= room_bytes[k]) & ((need_out <= 0) | (j < len(outflow)))
                nacc = len(ok) if ok.all() else int(np.argmin(ok))
                if prio == Priority.PROMOTE:
                    # the next promotion in line, if the room alone held it back (the budget had it)
                    if nacc < len(cand) and inflow[nacc] > room_bytes[k] and inflow[nacc] <= left:
                        deferred[k] = max(deferred[k], float(st.sizes[cand[nacc]]))
                if nacc == 0:
                    continue
                chosen.append((cand[:nacc], int(prio)))
                took = float(inflow[nacc - 1])
                room_bytes[k] -= took
                free_bytes[k] = max(free_bytes[k] - took, 0.0)
                left -= took
                if need_out[nacc - 1] > 0:
                    pair = out_k[:int(j[nacc - 1]) + 1]
                    paired.append(pair)
                    pair_bytes = float(st.sizes[pair].sum())
                    left -= pair_bytes
                    free_bytes[k] += pair_bytes
        return chosen, paired, left, deferred

    def _demotions(self, st: TickState, downs, paired: list[np.ndarray], left: float, room_bytes,
                   marks: Marks, shed: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """The paired demotions first (already paid for), then coldest first with tiers under
        pressure ahead of the others, at most ``shed`` bytes out of each tier (blocks over a quota
        leave whatever it says), while the budget lasts and each destination has room."""
        down, down_from = downs
        top = st.fixed_key
        pairs = np.concatenate(paired) if paired else np.zeros(0, np.int64)
        unpaired = ~marks.isin(down, pairs) if len(pairs) else np.ones(len(down), bool)
        rest = self._within_shed(st, down[unpaired], down_from[unpaired], shed, marks)
        if left > 0 and len(rest):
            cold_rank = top - 1 - st.rank_key[rest] + np.where(st.pressure[st.tier_now[rest]], 0, top)
            rest = ordered_prefix(rest, cold_rank, st.sizes[rest], left)
        else:
            rest = rest[:0]
        order = np.concatenate([pairs, rest]).astype(np.int64)
        if len(order) == 0:
            return []
        dest = st.tier_target[order]
        fits = np.ones(len(order), bool)
        for k in range(len(self.tiers)):
            sel = dest == k
            if sel.any():
                fits[sel] = np.cumsum(st.sizes[order[sel]]) <= room_bytes[k]
        npairs = int(fits[:len(pairs)].sum())
        order = order[fits]
        affordable = np.ones(len(order), bool)
        affordable[npairs:] = np.cumsum(st.sizes[order[npairs:]]) <= left
        order = order[affordable]
        return [(order, int(Priority.DEMOTE))] if len(order) else []

    def _within_shed(self, st: TickState, rest: np.ndarray, rest_from: np.ndarray, shed: np.ndarray,
                     marks: Marks) -> np.ndarray:
        """Of the unpaired demotion candidates (coldest first per source tier, as
        _move_candidates orders them), those that bring each tier down to ``shed`` bytes out — the
        block that crosses it included, so a tier under pressure ends at or below its low
        watermark — plus every block pushed out by a quota."""
        if np.isinf(shed).all() or len(rest) == 0:
            return rest
        keep = np.zeros(len(rest), bool)
        for k in np.flatnonzero(shed > 0):
            at = np.flatnonzero(rest_from == k)
            cs = np.cumsum(st.sizes[rest[at]])
            keep[at[:int(np.searchsorted(cs, shed[k], side="left")) + 1]] = True
        if len(st.quota_pushed):
            keep |= marks.isin(rest, st.quota_pushed)
        return rest[keep]

    def _to_plan(self, table: BlockTable, st: TickState, chosen, planned: np.ndarray, planned_total: float,
                 budget_bytes: float) -> Plan:
        if chosen:
            blocks = np.concatenate([b for b, _ in chosen]).astype(np.int64)
            prio = np.concatenate([np.full(len(b), p, np.int8) for b, p in chosen])
        else:
            blocks, prio = np.zeros(0, np.int64), np.zeros(0, np.int8)
        to_index = st.tier_target[blocks].astype(np.int64)
        nodes = np.array([self._node_for(table, k) for k in range(len(self.tiers))], np.int16)
        to_node = nodes[to_index]
        moved = {p.name: float(st.sizes[blocks[prio == int(p)]].sum()) for p in Priority}
        return Plan(moves=self._coalesce(table, blocks, to_node, prio), blocks=blocks,
                    to_tier=self.tier_values[to_index], to_node=to_node, priority=prio,
                    planned_bytes={Tier(int(tv)).label: float(b) for tv, b in zip(self.tier_values, planned)},
                    moved_bytes=moved, deferred_bytes=max(planned_total - sum(moved.values()), 0.0),
                    now_ms=st.now_ms, budget_bytes=budget_bytes)

    def _node_for(self, table: BlockTable, k: int) -> int:
        """The tier's node with the fewest managed bytes (all moves into a tier this tick go there)."""
        nodes = self.tiers[k].nodes
        if not nodes:
            return -1
        return min(nodes, key=lambda nd: table.node_bytes[nd])

    @staticmethod
    def _coalesce(table: BlockTable, blocks: np.ndarray, to_node: np.ndarray, prio: np.ndarray) -> list[Move]:
        """Adjacent blocks of one region with the same source, destination and priority → one Move."""
        if len(blocks) == 0:
            return []
        order = np.lexsort((blocks, prio))
        b, tn, pr = blocks[order], to_node[order], prio[order]
        rid = table.region[b]
        fn = table.node[b]
        brk = np.ones(len(b), bool)
        brk[1:] = (np.diff(b) != 1) | (rid[1:] != rid[:-1]) | (fn[1:] != fn[:-1]) | \
            (tn[1:] != tn[:-1]) | (pr[1:] != pr[:-1])
        starts = np.flatnonzero(brk)
        pid, addr = table.block_address(b[starts])
        lens = np.add.reduceat(table.size[b], starts)
        return [Move(pid=int(pid[i]), start=int(addr[i]), length=int(lens[i]), from_node=int(fn[s]),
                     to_node=int(tn[s]), priority=Priority(int(pr[s])))
                for i, s in enumerate(starts)]
