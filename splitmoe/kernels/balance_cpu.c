/* The balancer's per-layer replica choice on the CPU: one call per layer (two for `global`,
 * whose count all-gather sits between them), bit-identical to the PyTorch reference
 * `splitmoe.eplb.policy.assign` (see that module for the policies and the water-filling).
 *
 * Built once per source hash with the system compiler and loaded with ctypes
 * (`splitmoe.kernels.balance_cpu`); it reads and writes the tensors' memory in place.
 * All arithmetic is int64, as the reference's, so every attention rank reaches the same choice.
 *
 * Return codes: 0 ok; -1 an expert id outside [0, E); -2 `counts` disagrees with the ids
 * (the rank's pairs of an expert exceed what its quotas hand out); -3 out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t E;                   /* experts */
    int64_t M;                   /* most replicas of an expert (columns of `slots`) */
    int64_t R;                   /* expert ranks */
    int64_t E2;                  /* experts with more than one replica */
    const int64_t *nrep;         /* [E] replicas of each expert */
    const int64_t *slots;        /* [E, M] slot of replica j of expert e (ReplicaTable) */
    const int64_t *static_slot;  /* [E] this attention rank's replica under `static` */
    const int64_t *multi;        /* [E2] the multi-replica experts, ascending */
    const int64_t *replica_rank; /* [E, M] expert rank of each replica */
    int64_t S;                   /* slots */
    const int64_t *slot_expert;  /* [S] expert each slot holds */
    const int64_t *slot_rank;    /* [S] expert rank of each slot */
    const int64_t *direct;       /* [E] the slot of a single-replica expert, else -1 - its
                                    row q among the multi experts */
} table_t;

/* Pairs per expert of ids into counts[e] (+=), checking the ids. Four histograms, one per lane
 * of four consecutive pairs, summed at the end: a single `counts[e] += 1` chain waits on the
 * previous store whenever an expert repeats within a few pairs (hot experts), ~10% of the
 * `static` call. `out`: when not NULL, out[i] = lookup[ids[i]] in the same pass. */
#define LANE_MAX 1024
static int histogram(const int64_t *restrict ids, int64_t P, int64_t E, int64_t *restrict counts,
                     const int64_t *restrict lookup, int64_t *restrict out) {
    if (E > LANE_MAX) {
        for (int64_t i = 0; i < P; i++) {
            int64_t e = ids[i];
            if ((uint64_t)e >= (uint64_t)E) return -1;
            if (out) out[i] = lookup[e];
            counts[e] += 1;
        }
        return 0;
    }
    int32_t h[4][LANE_MAX];
    memset(h, 0, sizeof(h[0]) * 4);
    const uint64_t n = (uint64_t)E;
    int64_t i = 0;
    for (; i + 4 <= P; i += 4) {
        int64_t e0 = ids[i], e1 = ids[i + 1], e2 = ids[i + 2], e3 = ids[i + 3];
        if ((uint64_t)e0 >= n || (uint64_t)e1 >= n || (uint64_t)e2 >= n || (uint64_t)e3 >= n)
            return -1;
        if (out) {
            out[i] = lookup[e0];
            out[i + 1] = lookup[e1];
            out[i + 2] = lookup[e2];
            out[i + 3] = lookup[e3];
        }
        h[0][e0]++;
        h[1][e1]++;
        h[2][e2]++;
        h[3][e3]++;
    }
    for (; i < P; i++) {
        int64_t e = ids[i];
        if ((uint64_t)e >= n) return -1;
        if (out) out[i] = lookup[e];
        h[0][e]++;
    }
    for (int64_t e = 0; e < E; e++) counts[e] += (int64_t)h[0][e] + h[1][e] + h[2][e] + h[3][e];
    return 0;
}

/* `static`: out[i] = static_slot[ids[i]]; load[ids[i]] += 1 per pair. */
int smb_static(const table_t *t, const int64_t *restrict ids, int64_t P, int64_t *restrict out,
               int64_t *restrict load) {
    return histogram(ids, P, t->E, load, t->static_slot, out);
}

/* counts[e] = pairs of expert e in ids (written); load[e] += counts[e]. */
int smb_count(const int64_t *restrict ids, int64_t P, int64_t E, int64_t *restrict counts,
              int64_t *restrict load) {
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    int rc = histogram(ids, P, E, counts, NULL, NULL);
    if (rc) return rc;
    for (int64_t e = 0; e < E; e++) load[e] += counts[e];
    return 0;
}

/* `deal`: the pairs of each expert in row-major order go take[q, 0] to its replica 0, the next
 * take[q, 1] to replica 1, ... (`take [E2, M]` for the multi experts; a single-replica expert's
 * pairs all go to its one slot). Branch-free per pair: `fill` lists, expert after expert, the
 * slot of each of its pairs in order (counting-sort offsets), and pair i takes the next entry
 * of its expert's run (a branch on "one replica or several" mispredicts on ~half the pairs). */
static int deal(const table_t *t, const int64_t *restrict ids, int64_t P,
                const int64_t *restrict counts, const int64_t *restrict take,
                int64_t *restrict out) {
    const int64_t E = t->E, M = t->M;
    int64_t *cursor = malloc((size_t)(E + P + 1) * sizeof(int64_t));
    if (!cursor) return -3;
    int64_t *fill = cursor + E, at = 0;
    for (int64_t e = 0; e < E; e++) {
        cursor[e] = at;
        int64_t d = t->direct[e], n = counts[e];
        if (at + n > P) goto bad;
        if (d >= 0) {
            for (int64_t i = 0; i < n; i++) fill[at + i] = d;
        } else {
            const int64_t *row = take + (-1 - d) * M, *slots = t->slots + e * M;
            int64_t end = at + n;
            for (int64_t jj = 0; jj < t->nrep[e]; jj++) {
                int64_t stop = at + row[jj];
                if (stop > end) goto bad;
                for (; at < stop; at++) fill[at] = slots[jj];
            }
            if (at != end) goto bad;
            continue;
        }
        at += n;
    }
    if (at != P) goto bad;
    for (int64_t i = 0; i < P; i++) out[i] = fill[cursor[ids[i]]++];
    free(cursor);
    return 0;
bad:
    free(cursor);
    return -2;
}

/* `local`: attention rank a's pair o of expert e (in row-major order) goes round-robin to
 * replica (a + o) mod n; as counts per replica: (((a - 1 - j) mod n) + mine) // n. */
int smb_local(const table_t *t, const int64_t *ids, int64_t P, int64_t a, const int64_t *counts,
              int64_t *out) {
    const int64_t M = t->M;
    int64_t *take = calloc((size_t)(t->E2 * M + 1), sizeof(int64_t));
    if (!take) return -3;
    for (int64_t q = 0; q < t->E2; q++) {
        int64_t e = t->multi[q], n = t->nrep[e], mine = counts[e];
        for (int64_t jj = 0; jj < n; jj++) {
            int64_t r = (a - 1 - jj) % n;
            if (r < 0) r += n;
            take[q * M + jj] = (r + mine) / n;
        }
    }
    int rc = deal(t, ids, P, counts, take, out);
    free(take);
    return rc;
}

/* `global`: `all [A, E]` every attention rank's pairs per expert (rank order), `counts [E]`
 * this rank's (= all[a]). The water-filling of `_water_fill` per multi expert, then this rank's
 * cut [lo, hi) of the global order, then `deal`. */
int smb_global(const table_t *t, const int64_t *restrict ids, int64_t P, int64_t a, int64_t A,
               const int64_t *restrict all, const int64_t *restrict counts, int64_t activate,
               int64_t *restrict out) {
    const int64_t E = t->E, M = t->M, R = t->R;
    int64_t *buf = calloc((size_t)(t->E2 * M + 2 * E + R + 5 * M + 1), sizeof(int64_t));
    if (!buf) return -3;
    int64_t *take = buf;                /* [E2, M] */
    int64_t *totals = take + t->E2 * M; /* [E] */
    int64_t *own = totals + E;          /* [E] cost per replica under even splits */
    int64_t *rank_cost = own + E;       /* [R] */
    int64_t *c = rank_cost + R, *idx = c + M, *tt = idx + M; /* [M] each, sorted replicas */
    for (int64_t e = 0; e < E; e++) {
        int64_t sum = 0;
        for (int64_t r = 0; r < A; r++) sum += all[r * E + e];
        totals[e] = sum;
    }
    for (int64_t e = 0; e < E; e++) {
        /* most experts have one replica: no division (a 64-bit one costs ~30 cycles) */
        int64_t share = t->nrep[e] == 1 ? totals[e] : totals[e] / t->nrep[e];
        own[e] = share + activate * (share > 0 ? 1 : 0);
    }
    /* summed in a register while the rank stays the same (slots are rank-major): a += through
     * memory per slot waits on the previous store (~3x slower) */
    int64_t rank = t->slot_rank[0], acc = 0;
    for (int64_t s = 0; s < t->S; s++) {
        if (t->slot_rank[s] != rank) {
            rank_cost[rank] += acc;
            acc = 0;
            rank = t->slot_rank[s];
        }
        acc += own[t->slot_expert[s]];
    }
    rank_cost[rank] += acc;
    for (int64_t q = 0; q < t->E2; q++) {
        int64_t e = t->multi[q], m = t->nrep[e], n = totals[e];
        /* c: the rank's cost from the other slots on it; stable sort, cheapest first */
        for (int64_t jj = 0; jj < m; jj++) {
            int64_t cj = rank_cost[t->replica_rank[e * M + jj]] - own[e];
            int64_t k = jj;
            while (k > 0 && c[k - 1] > cj) {
                c[k] = c[k - 1];
                idx[k] = idx[k - 1];
                k--;
            }
            c[k] = cj;
            idx[k] = jj;
        }
        /* the first minimum of L(i + 1) = (c_0 + .. + c_i + n) // (i + 1) */
        int64_t run = n, best = 0, used = 0;
        for (int64_t i = 0; i < m; i++) {
            run += c[i];
            tt[i] = run;
            int64_t level = run / (i + 1);
            if (i == 0 || level < best) {
                best = level;
                used = i;
            }
        }
        int64_t rem = tt[used] % (used + 1);
        /* pairs left after replica i, running minimum; this rank's range [lo, hi) */
        int64_t hi = 0;
        for (int64_t r = 0; r <= a; r++) hi += all[r * E + e];
        int64_t lo = hi - counts[e], prev = lo, cm = INT64_MAX;
        for (int64_t i = 0; i < m; i++) {
            int64_t left = tt[i] - (i + 1) * best - (i + 1 < rem ? i + 1 : rem);
            if (left < cm) cm = left;
            int64_t end = n - cm;
            end = end < lo ? lo : (end > hi ? hi : end);
            take[q * M + idx[i]] = end - prev;
            prev = end;
        }
    }
    int rc = deal(t, ids, P, counts, take, out);
    free(buf);
    return rc;
}
