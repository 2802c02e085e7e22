/* Model of the summation order of the pinned OpenBLAS's single-thread SGEMM, Haswell core.
 *
 * Pinned build: PyPI scipy-openblas32 0.3.34.481.3 (OpenBLAS 0.3.34; the order is the same
 * in 0.3.28-0.3.34), OPENBLAS_CORETYPE=Haswell. Written from reading OpenBLAS's source:
 *   driver/level3/level3.c:292-305   K blocks (GEMM_Q, the GEMM_UNROLL_M rounding of min_l)
 *   driver/level3/level3.c:317-401   M blocks (GEMM_P) and N chunks (min_jj: 3*UNROLL_N, or
 *                                    UNROLL_N) handed to the kernel, first and later is-blocks
 *   param.h:1552-1603 (HASWELL)      SGEMM P=320 Q=320 UNROLL_M=8 UNROLL_N=4
 *   param.h:1679-1725 (SKYLAKEX)     SGEMM P=448 Q=448 UNROLL_M=16 UNROLL_N=4
 *   kernel/x86_64/sgemm_kernel_8x4_haswell_2.c   which tiles keep split accumulators
 * for a ROW-MAJOR cblas call C = alpha*A@B + beta*C. A row-major (Mr x Nr) C is the
 * column-major (m = Nr, n = Mr) problem inside OpenBLAS.
 *
 * Modes of model():
 *   0  the Haswell kernel: one FMA chain per output in k order within each K block, except
 *      in the m8n4 tiles and in the outer 8-row strips (H/T m8n6 halves) of the n12 panels,
 *      which keep two accumulators (even k, odd k; the K%8 tail goes to the even one) and
 *      add them at the end of the block; then C = fma(alpha, block sum, C) per K block.
 *   1  one FMA chain per output in k order within each of Haswell's K blocks (Q=320,
 *      UNROLL_M=8): what a pure single-chain kernel (the SkylakeX one) gives when called
 *      once per Haswell K block with beta=1 after the first.
 *   2  like 1, with the K blocks of the q/um arguments (SkylakeX's own: 448/16).
 *
 * Build (the Python scripts beside it do this in a temporary directory):
 *   gcc -O2 -ffp-contract=off -fPIC -shared -o haswell_model.so haswell_model.c -lm
 * -ffp-contract=off keeps the compiler from fusing the a+b of the accumulators into FMAs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef long L;

/* The K-block boundaries of level3.c:292-305: starts[] and lens[]; returns their number. */
int kblocks(L k, L q, L um, L *starts, L *lens) {
    int nb = 0;
    for (L ls = 0; ls < k;) {
        L min_l = k - ls;
        if (min_l >= 2 * q) min_l = q;
        else if (min_l > q) min_l = ((min_l / 2 + um - 1) / um) * um;
        starts[nb] = ls;
        lens[nb] = min_l;
        nb++;
        ls += min_l;
    }
    return nb;
}

/* Set mark[mm + cc*ldm] = 1 for each internal (row mm, column cc) output that one Haswell
 * kernel call, covering internal rows [m0, m0+m) and columns [n0, n0+n), sums with split
 * accumulators. The kernel walks n in panels of 12, then 8, then 4 columns. */
static void kernel_map(L m, L n, L m0, L n0, L ldm, unsigned char *mark) {
    L nc = n, col = n0;
#define MARK(mm_lo, mm_hi, c_lo, c_hi)                     \
    for (L cc = (c_lo); cc < (c_hi); cc++)                 \
        for (L mm = (mm_lo); mm < (mm_hi); mm++) mark[(m0 + mm) + (cc) * ldm] = 1;
    for (; nc > 11; nc -= 12, col += 12) {     /* n12 panels */
        if (m >= 16) {
            L m8 = (m / 8) * 8, c8 = m8 / 8;
            MARK(0, 8, col, col + 6);          /* head strip: H_m8n6, left half */
            if (c8 % 2 == 0) {
                MARK(m8 - 8, m8, col, col + 6);        /* tail strip: T_m8n6, left half */
            } else {
                MARK(m8 - 8, m8, col + 6, col + 12);   /* tail strip: T_m8n6, right half */
            }
        }
    }
    for (; nc > 7; nc -= 8, col += 8) {}       /* n8 panels: single chains */
    for (; nc > 3; nc -= 4, col += 4) {        /* n4 panels: COMPUTE_m8n4 on all full m8 rows */
        MARK(0, (m / 8) * 8, col, col + 4);
    }
#undef MARK
}

/* The split map of a whole call (the same for every K block): the kernel calls of
 * level3.c:317-401, with P=p, UNROLL_M=um, UNROLL_N=un. */
static void split_map(L m, L n, L p, L um, L un, unsigned char *mark) {
    memset(mark, 0, (size_t)(m * n));
    L min_i = m;
    if (min_i >= 2 * p) min_i = p;
    else if (min_i > p) min_i = ((min_i / 2 + um - 1) / um) * um;
    for (L jjs = 0; jjs < n;) {                /* first is-block: in min_jj chunks */
        L min_jj = n - jjs;
        if (min_jj >= 3 * un) min_jj = 3 * un;
        else if (min_jj > un) min_jj = un;
        kernel_map(min_i, min_jj, 0, jjs, m, mark);
        jjs += min_jj;
    }
    for (L is = min_i; is < m;) {              /* later is-blocks: the whole width at once */
        L mi = m - is;
        if (mi >= 2 * p) mi = p;
        else if (mi > p) mi = ((mi / 2 + um - 1) / um) * um;
        kernel_map(mi, n, is, 0, m, mark);
        is += mi;
    }
}

/* C = alpha*A@B + beta*C in the order of `mode` (see the top). a: Mr x K row-major (lda=K),
 * b: K x Nr row-major (ldb=Nr), c: Mr x Nr row-major, in and out. q/um: mode 2's K blocks.
 * mark_out (NULL or Mr*Nr bytes): 1 where mode 0 uses split accumulators, row-major.
 * Returns the number of K blocks. */
int model(int mode, L Mr, L Nr, L K, float alpha, const float *a, const float *b, float beta,
          float *c, L q, L um, unsigned char *mark_out) {
    L m = Nr, n = Mr; /* internal column-major sizes */
    L starts[4096], lens[4096];
    if (mode < 2) {
        q = 320;
        um = 8;
    }
    int nb = kblocks(K, q, um, starts, lens);
    unsigned char *mark = calloc((size_t)(m * n), 1);
    if (mode == 0) split_map(m, n, 320, 8, 4, mark);
    if (mark_out) memcpy(mark_out, mark, (size_t)(m * n));
    if (beta != 1.0f)
        for (L i = 0; i < Mr * Nr; i++) c[i] = (beta == 0.0f) ? 0.0f : beta * c[i];
    if (K == 0 || alpha == 0.0f) {
        free(mark);
        return nb;
    }
    for (L i = 0; i < Mr; i++)
        for (L j = 0; j < Nr; j++) {
            int split = mark[j + i * m];
            float cij = c[i * Nr + j];
            for (int bl = 0; bl < nb; bl++) {
                L k0 = starts[bl], kc = lens[bl];
                float acc0 = 0.0f, acc1 = 0.0f;
                L kk = 0;
                if (split && kc >= 8) {        /* the unrolled body: even k / odd k */
                    L body = (kc / 8) * 8;
                    for (; kk < body; kk += 2) {
                        acc0 = fmaf(a[i * K + k0 + kk], b[(k0 + kk) * Nr + j], acc0);
                        acc1 = fmaf(a[i * K + k0 + kk + 1], b[(k0 + kk + 1) * Nr + j], acc1);
                    }
                }
                for (; kk < kc; kk++) acc0 = fmaf(a[i * K + k0 + kk], b[(k0 + kk) * Nr + j], acc0);
                float s = split ? acc0 + acc1 : acc0;
                cij = fmaf(alpha, s, cij);
            }
            c[i * Nr + j] = cij;
        }
    free(mark);
    return nb;
}
