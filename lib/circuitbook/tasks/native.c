/* Fused CPU kernels of the training samplers: the batches that their torch ops make (tasks/draws.py,
 * AssignAddSampler, BlockListSampler), made row by row. A row's words, choices and tokens stay in registers
 * and the L1 cache instead of streaming through memory once per torch op, which is what the torch form costs
 * on a CPU. Every integer here is exact and the arithmetic is the one draws.py defines, so the batches are
 * bit for bit those of the torch form: circuitbook.tasks.native checks that on every machine before it uses
 * them, and the tests compare both forms over every planned run.
 *
 * Conventions: every array is a contiguous int64 array; "rows" of a member are step-major (s * B + r).
 */
#include <stdint.h>
#include <string.h>

typedef uint32_t u32;
typedef uint64_t u64;
typedef int64_t i64;

/* draws.mix: lowbias32 */
static inline u32 mix(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* the lanes (a, b) after absorbing one word */
static inline void absorb(u32 *a, u32 *b, u32 word) {
    *a = mix(*a ^ word);
    *b = mix(*b ^ *a);
}

/* draws.below: (w * n) >> 32 */
static inline i64 below(u32 w, i64 n) { return (i64)(((u64)w * (u64)n) >> 32); }

/* draws.categorical: how many thresholds the word reaches */
static inline i64 categorical(u32 w, const i64 *thresholds, i64 n) {
    i64 c = 0;
    for (i64 i = 0; i < n; i++) c += (i64)w >= thresholds[i];
    return c;
}

/* The member x step x row walk of every kernel: row r of member k at step steps[s] gets its words
   word(key_k, steps[s], site, r, c), c < width (draws.Stream.words), and make_row writes its seq_len tokens and
   its label at row k * S * B + s * B + r of tokens [K, S * B, seq_len] and labels [K, S * B]. */
enum { MAX_ROW = 1024 };  /* the most words (choices) and tokens of a row */
typedef void (*make_row_fn)(const void *task, i64 k, const u32 *w, i64 *tokens, i64 *label);

/* always_inline: then each kernel's row maker is a known function here and inlined into the loop; called through
   the pointer it was not, 0.74-0.91x the speed of the two copied loops before (benchmarks/README) */
static inline __attribute__((always_inline)) void walk_rows(const void *task, make_row_fn make_row, i64 width,
        i64 seq_len, i64 K, i64 S, i64 B, const i64 *steps, const i64 *lane_a, const i64 *lane_b, i64 site,
        i64 *tokens, i64 *labels) {
    u32 w[MAX_ROW];
    for (i64 k = 0; k < K; k++)
        for (i64 s = 0; s < S; s++) {
            u32 a = (u32)lane_a[k], b = (u32)lane_b[k];
            absorb(&a, &b, (u32)steps[s]);
            for (i64 r = 0; r < B; r++) {
                u32 ra = a, rb = b;
                absorb(&ra, &rb, (u32)(site << 24 | r));
                u32 odd = 2 * ra + 1;
                for (i64 c = 0; c < width; c++) w[c] = mix(rb ^ ((u32)c * odd));
                i64 at = k * S * B + s * B + r;
                make_row(task, k, w, tokens + at * seq_len, labels + at);
            }
        }
}

/* ------------------------------------------------------------------ assign_add */

enum { N_VARS = 12, PREFIX_LEN = 12, SEQ_LEN = 16, MAX_ASSIGNMENTS = 6, MAX_DISTRACTORS = 5, MAX_SETS = 7,
       MAX_COPIES = 3, PLACES = MAX_ASSIGNMENTS + MAX_COPIES, TWO_VAR_LEFT_WIDTH = 10, N_TYPES = 4,
       ZERO_VAR = 0, ONE_VAR_LEFT = 1, ONE_VAR_RIGHT = 2, TWO_VAR = 3,
       W_TYPE = 0, W_SLOT, W_PAIR, W_LEFT, W_FIRST_VALUE, W_COUNT, W_SUBSET, W_LAYOUT, W_VALUES,
       ROW_WORDS = W_VALUES + MAX_DISTRACTORS };

struct aa_tables {
    i64 modulus, pad, var0, plus, eq, pair_width;
    const i64 *type_thresholds;          /* [K, N_TYPES - 1] */
    const i64 *pairs, *n_pairs, *repeats; /* [K, pair_width], [K], [K] */
    const i64 *row_vars, *n_row_vars;    /* [N_TYPES * N_VARS], [N_TYPES] */
    const i64 *left_table, *left_count;  /* [N_VARS * 10], [N_VARS] */
    const i64 *subsets, *subset_start, *subset_count; /* [*, 5], [(N_VARS + 1) * MAX_SETS] x 2 */
    const i64 *layouts, *layout_start, *layout_count; /* [*, PLACES], [MAX_ASSIGNMENTS + 1] x 2 */
};

/* AssignAddSampler.queries + render for one row of member k from its words w */
static void aa_row(const void *task, i64 k, const u32 *w, i64 *tokens, i64 *label) {
    const struct aa_tables *t = task;
    const i64 N = t->modulus;
    /* the query core */
    i64 type = categorical(w[W_TYPE], t->type_thresholds + k * (N_TYPES - 1), N_TYPES - 1);
    i64 var = t->row_vars[type * N_VARS + below(w[W_SLOT], t->n_row_vars[type])];
    i64 pair = t->pairs[k * t->pair_width + below(w[W_PAIR], t->n_pairs[k])];
    i64 two_left = t->left_table[var * TWO_VAR_LEFT_WIDTH + below(w[W_LEFT], t->left_count[var])];
    i64 left = type == ONE_VAR_LEFT ? var : (type == TWO_VAR ? two_left : -1);
    i64 right = (type == ONE_VAR_RIGHT || type == TWO_VAR) ? var : -1;
    i64 featured = type == ZERO_VAR ? var : -1;
    i64 n1 = pair / N, n2 = pair % N;
    *label = (n1 + n2) % N;

    /* the prefix */
    int has_left = left >= 0, has_right = right >= 0;
    i64 first_var = has_left ? left : featured;
    i64 first_val = has_left ? n1 : below(w[W_FIRST_VALUE], N);
    i64 reps = t->repeats[k];
    i64 c_first = has_left ? reps : (first_var >= 0);
    i64 c_req = c_first + (has_right ? reps : 0);
    i64 n_req = (first_var >= 0) + has_right;
    i64 d = below(w[W_COUNT], MAX_SETS - c_req);
    i64 sets = (N_VARS - n_req) * MAX_SETS + d;
    i64 pick = t->subset_start[sets] + below(w[W_SUBSET], t->subset_count[sets]);
    const i64 *subset = t->subsets + pick * MAX_DISTRACTORS;
    i64 r1 = first_var >= 0 ? first_var : N_VARS, r2 = has_right ? right : N_VARS;
    i64 lo = r1 < r2 ? r1 : r2, hi = r1 < r2 ? r2 : r1;
    i64 kk = d + c_req;
    i64 row = t->layout_start[kk] + below(w[W_LAYOUT], t->layout_count[kk]);
    const i64 *place = t->layouts + row * PLACES;

    /* the writes in the torch form's order: a later write overwrites an earlier one (a copy beyond its
       count lands on a later block's place or in the core's columns, which the core overwrites last) */
    i64 buf[SEQ_LEN + 2];
    for (int i = 0; i < SEQ_LEN; i++) buf[i] = t->pad;
    for (int i = 0; i < MAX_DISTRACTORS; i++) {
        i64 v = subset[i] + (subset[i] >= lo);
        v += v >= hi;
        buf[place[i]] = t->var0 + v;
        buf[place[i] + 1] = below(w[W_VALUES + i], N);
    }
    for (int j = 0; j < MAX_COPIES; j++) {
        i64 p = place[d + j];
        buf[p] = t->var0 + first_var;
        buf[p + 1] = first_val;
    }
    for (int j = 0; j < MAX_COPIES; j++) {
        i64 p = place[d + c_first + j];
        buf[p] = t->var0 + right;
        buf[p + 1] = n2;
    }
    buf[PREFIX_LEN] = t->plus;
    buf[PREFIX_LEN + 1] = has_left ? t->var0 + left : n1;
    buf[PREFIX_LEN + 2] = has_right ? t->var0 + right : n2;
    buf[PREFIX_LEN + 3] = t->eq;
    memcpy(tokens, buf, SEQ_LEN * sizeof(i64));
}

/* tokens [K, S * B, 16] and labels [K, S * B] of K members at S steps (AssignAddSampler.__call__) */
void assign_add_batches(const struct aa_tables *t, i64 K, i64 S, i64 B, const i64 *steps, const i64 *lane_a,
                        const i64 *lane_b, i64 site, i64 *tokens, i64 *labels) {
    walk_rows(t, aa_row, ROW_WORDS, SEQ_LEN, K, S, B, steps, lane_a, lane_b, site, tokens, labels);
}

/* ------------------------------------------------------------------ block lists */

enum { KIND_RECALL = 0, KIND_KHOP, KIND_NGRAM, KIND_IOI, KIND_CONDITIONAL };

struct blocklist_task {
    i64 kind, n_pairs, n_rare, n_blocks, burstiness, n_fill, bos, bos_token, composite, has_rare;
    i64 chain_len, block_len, query_len, n_distractors, common_draws, n_common, n_tokens, seq_len;
    i64 n_choices;
    /* the columns of the choices in a row's words (BlockListTask.choices): pair j at pair0 + 2 j, its orient
       one after; rare (has_rare) then rare j at rare + 1 + j; canon i at canon + i; order j at order + j; gap f
       at gap + 2 f, its fill one after; offset */
    i64 col_pair0, col_rare, col_canon, col_order, col_gap, col_offset;
    const i64 *sizes;                    /* [n_choices] outcomes of each choice */
    const i64 *law_start, *law_count;    /* [n_choices]: a choice with a member law reads law_count thresholds */
    const i64 *laws;                     /* [K, law_width] every member's thresholds */
    i64 law_width;
};

/* _decode_lehmer: codes u_j in [0, n - j) -> the first m elements of a permutation of range(n), element j the
   u_j-th smallest of those not taken before it. Where n is small next to m^2: read it off the sorted list of
   the elements not yet taken (m removals of a few bytes); else torch's form (from the last code to the first,
   every later element at or above an earlier one moves up by one). Both compute that definition. */
enum { MAX_AVAILABLE = 4096 };
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* n <= 64: the set of elements not taken as a bit mask; the u-th of them is the u-th set bit (pdep) */
__attribute__((target("bmi2"))) static void lehmer_pdep(i64 *x, i64 m, i64 n) {
    u64 available = n == 64 ? ~0ULL : (1ULL << n) - 1;
    for (i64 j = 0; j < m; j++) {
        u64 bit = _pdep_u64(1ULL << x[j], available);
        x[j] = __builtin_ctzll(bit);
        available ^= bit;
    }
}
/* pdep is one instruction where BMI2 is, except on AMD's Zen 1 and 2 (microcoded, hundreds of cycles) */
static int pdep_is_fast(void) {
    static int fast = -1;
    if (fast < 0) {
        __builtin_cpu_init();
        fast = __builtin_cpu_supports("bmi2") && !__builtin_cpu_is("znver1") && !__builtin_cpu_is("znver2");
    }
    return fast;
}
#else
static int pdep_is_fast(void) { return 0; }
static void lehmer_pdep(i64 *x, i64 m, i64 n) { (void)x; (void)m; (void)n; }
#endif
static void lehmer(i64 *x, i64 m, i64 n) {
    if (n <= 64 && pdep_is_fast()) {
        lehmer_pdep(x, m, n);
        return;
    }
    if (m * m > n && n <= MAX_AVAILABLE) {
        int16_t available[MAX_AVAILABLE];
        for (i64 i = 0; i < n; i++) available[i] = (int16_t)i;
        for (i64 j = 0; j < m; j++) {
            i64 u = x[j];
            x[j] = available[u];
            memmove(available + u, available + u + 1, (size_t)(n - j - 1 - u) * sizeof(int16_t));
        }
        return;
    }
    for (i64 j = m - 2; j >= 0; j--)
        for (i64 i = j + 1; i < m; i++) x[i] += x[i] >= x[j];
}

/* BlockListTask.assemble + build + _lay_out + model_inputs for one row of member k from its words */
static void blocklist_row(const void *task, i64 k, const u32 *w, i64 *out, i64 *target) {
    const struct blocklist_task *t = task;
    /* arrays of the row's own sizes: a frame of fixed 1,024-element arrays (80 kB) cost more than the row */
    i64 v[t->n_choices];
    for (i64 j = 0; j < t->n_choices; j++)
        v[j] = t->law_count[j] ? categorical(w[j], t->laws + k * t->law_width + t->law_start[j], t->law_count[j])
                               : below(w[j], t->sizes[j]);
    const i64 D = t->common_draws, n = t->n_distractors, L = t->block_len, cl = t->chain_len;
    const i64 nb = t->n_blocks, q = t->query_len, F = t->n_fill;
    i64 pairs[D], fresh[D], partner[D];
    for (i64 j = 0; j < D; j++) pairs[j] = v[t->col_pair0 + 2 * j];
    lehmer(pairs, D, t->n_pairs);
    for (i64 j = 0; j < D; j++) {
        i64 o = v[t->col_pair0 + 2 * j + 1];
        fresh[j] = 2 * pairs[j] + o;
        partner[j] = 2 * pairs[j] + 1 - o;
    }
#define TAKE(table, idx) ((table)[(idx) < D - 1 ? (idx) : D - 1])
    int is_rare = t->has_rare ? v[t->col_rare] != 0 : 0;
    const i64 *canon = v + t->col_canon;  /* canon[0]: the queried link, canon[1 + i]: distractor i's last */
    int linked = canon[0] != 0 && !is_rare;
    i64 rel[cl];
    for (i64 j = 0; j < cl - 1; j++) rel[j] = fresh[j];
    rel[cl - 1] = linked ? partner[cl - 2] : TAKE(fresh, cl - 1);
    if (is_rare) {
        i64 rare[cl];
        for (i64 j = 0; j < cl; j++) rare[j] = v[t->col_rare + 1 + j];
        lehmer(rare, cl, t->n_rare);
        for (i64 j = 0; j < cl; j++) rel[j] = t->n_common + rare[j];
    }
    /* the blocks before the permutation: the relevant ones (each burstiness times), then the distractors */
    i64 blocks[nb * L];
    i64 nrel = t->kind == KIND_KHOP ? cl - 1 : 1, at = 0;
    for (i64 h = 0; h < nrel; h++)
        for (i64 r = 0; r < t->burstiness; r++, at++)
            for (i64 c = 0; c < L; c++) blocks[at * L + c] = t->kind == KIND_KHOP ? rel[h + c] : rel[c];
    i64 body_len = t->kind == KIND_CONDITIONAL ? L - 2 : L - 1;
    i64 first = is_rare ? 0 : (cl - 1) + !linked;
    for (i64 i = 0; i < n; i++, at++) {
        i64 *block = blocks + at * L, c = 0;
        int canonical = canon[1 + i] != 0;
        if (t->kind == KIND_CONDITIONAL) block[c++] = rel[0];
        for (i64 b = 0; b < body_len; b++) block[c++] = TAKE(fresh, first + b);
        block[c] = canonical ? TAKE(partner, first + body_len - 1) : TAKE(fresh, first + body_len);
        first += body_len + !canonical;
    }
#undef TAKE
    i64 order[nb];
    for (i64 j = 0; j < nb; j++) order[j] = v[t->col_order + j];
    lehmer(order, nb, nb);
    /* the content: blocks in order, then the query; fillers in their gaps; BOS first */
    i64 query[q];
    if (t->kind == KIND_IOI) { query[0] = rel[1]; *target = rel[0]; }
    else { for (i64 j = 0; j < q; j++) query[j] = rel[j]; *target = rel[cl - 1]; }
    i64 tokens[t->seq_len], m = 0;
    if (t->bos) tokens[m++] = t->bos_token;
    i64 filled = 0;  /* fillers placed so far; filler f sits before block gaps[f] (gap nb: before the query) */
    for (i64 i = 0; i <= nb; i++) {
        /* the fillers whose gap is i, in the order of the free positions they fill */
        i64 before = 0;
        for (i64 f = 0; f < F; f++) before += v[t->col_gap + 2 * f] <= i;
        for (; filled < before; filled++) tokens[m++] = t->n_common + t->n_rare + v[t->col_gap + 2 * filled + 1];
        if (i < nb) for (i64 c = 0; c < L; c++) tokens[m++] = blocks[order[i] * L + c];
    }
    for (i64 j = 0; j < q; j++) tokens[m++] = query[j];
    i64 offset = v[t->col_offset], T = t->seq_len;
    for (i64 i = 0; i < T; i++) {
        i64 label = i + offset;
        label = label >= T ? label - T : label;
        out[i] = t->composite ? tokens[i] + t->n_tokens * label : tokens[i];
    }
}

/* tokens [K, S * B, seq_len] and targets [K, S * B] of K members at S steps (BlockListSampler's group) */
void blocklist_batches(const struct blocklist_task *t, i64 K, i64 S, i64 B, const i64 *steps, const i64 *lane_a,
                       const i64 *lane_b, i64 site, i64 *tokens, i64 *targets) {
    walk_rows(t, blocklist_row, t->n_choices, t->seq_len, K, S, B, steps, lane_a, lane_b, site, tokens, targets);
}
