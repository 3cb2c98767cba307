/* Shrink and recover of a structured subset as one pass each: the kernels behind sparsity.KernelPlan on CPU.
 *
 * A tensor is read as rows of n elements (its GEMM view); the kept rows all keep the same columns, given as a
 * bit mask (column j kept: bit j%8 of bits[j/8]). compress() packs the kept rows' kept columns into a dense
 * block, expand() writes the whole tensor back from that block, zeros elsewhere. ATen can only gather or
 * scatter single columns one element at a time; with AVX2 one shuffle moves a block of 8 columns (32-bit
 * elements) or 4 (64-bit), and offs[b] (kept columns before block b, the same in every row) makes the blocks
 * independent. With every column kept (filter structure) a kept row is one memcpy.
 * Rows are split over OpenMP threads (torch's own runtime: it is already loaded, so the soname resolves to it).
 * Built on first use by prunex_hvd.engine.sparsity.native; without AVX2 the scalar loops run. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PX_X86 1
#endif

typedef struct {
    const uint8_t* bits;
    const int32_t* offs;   /* nb + 1 entries: offs[nb] = c */
    int64_t n, c;          /* columns per row, kept columns per row */
    int64_t vb;            /* blocks [0, vb) are moved as whole vectors (see below) */
} cols_t;

static int32_t lut32_pack[256][8] __attribute__((aligned(32)));   /* lanes to take, in order */
static int32_t lut32_unpack[256][8] __attribute__((aligned(32))); /* per lane: its rank among the kept */
static int32_t lut32_keep[256][8] __attribute__((aligned(32)));   /* -1 where kept: an AND mask */
static int32_t lut64_pack[16][8] __attribute__((aligned(32)));    /* the same for 4 elements of 2 lanes */
static int32_t lut64_unpack[16][8] __attribute__((aligned(32)));
static int32_t lut64_keep[16][8] __attribute__((aligned(32)));
static int have_avx2;

static void init_luts(void) {
    for (int m = 0; m < 256; m++)
        for (int j = 0, k = 0; j < 8; j++)
            if (m >> j & 1) { lut32_pack[m][k] = j; lut32_unpack[m][j] = k; lut32_keep[m][j] = -1; k++; }
    for (int m = 0; m < 16; m++)
        for (int j = 0, k = 0; j < 4; j++)
            if (m >> j & 1) {
                lut64_pack[m][2 * k] = 2 * j; lut64_pack[m][2 * k + 1] = 2 * j + 1;
                lut64_unpack[m][2 * j] = 2 * k; lut64_unpack[m][2 * j + 1] = 2 * k + 1;
                lut64_keep[m][2 * j] = lut64_keep[m][2 * j + 1] = -1;
                k++;
            }
#ifdef PX_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
}

#define KEPT(p, j) ((p)->bits[(j) >> 3] >> ((j) & 7) & 1)

typedef uint32_t u32_t;
typedef uint64_t u64_t;

/* Without AVX2: one element at a time. */
#define SCALAR_ROW_FUNCTIONS(T)                                                                              \
    static void compress_row_##T(const cols_t* p, const T##_t* src, T##_t* dst) {                            \
        for (int64_t j = 0, o = 0; j < p->n; j++) if (KEPT(p, j)) dst[o++] = src[j];                         \
    }                                                                                                        \
    static void expand_row_##T(const cols_t* p, const T##_t* src, T##_t* dst) {                              \
        for (int64_t j = 0, i = 0; j < p->n; j++) dst[j] = KEPT(p, j) ? src[i++] : 0;                        \
    }
SCALAR_ROW_FUNCTIONS(u32)
SCALAR_ROW_FUNCTIONS(u64)

#ifdef PX_X86
#define AVX2 __attribute__((target("avx2")))
#define LOAD(p) _mm256_loadu_si256((const __m256i*)(p))
#define TABLE(t) _mm256_load_si256((const __m256i*)(t))
#define STORE(p, v) _mm256_storeu_si256((__m256i*)(p), v)

/* One block of 8 columns: pack its kept elements to d (8 lanes are stored; those past the kept ones are
 * strays), or spread them from s over 8 lanes with zeros between. */
AVX2 static inline void pack_u32(const uint32_t* s, unsigned m, uint32_t* d) {
    STORE(d, _mm256_permutevar8x32_epi32(LOAD(s), TABLE(lut32_pack[m])));
}
AVX2 static inline void unpack_u32(const uint32_t* s, unsigned m, uint32_t* d) {
    STORE(d, _mm256_and_si256(_mm256_permutevar8x32_epi32(LOAD(s), TABLE(lut32_unpack[m])), TABLE(lut32_keep[m])));
}
/* 64-bit elements: the block is two vectors of 4, split by the nibbles of its mask byte. */
AVX2 static inline void pack_u64(const uint64_t* s, unsigned m, uint64_t* d) {
    STORE(d, _mm256_permutevar8x32_epi32(LOAD(s), TABLE(lut64_pack[m & 15])));
    STORE(d + __builtin_popcount(m & 15), _mm256_permutevar8x32_epi32(LOAD(s + 4), TABLE(lut64_pack[m >> 4])));
}
AVX2 static inline void unpack_u64(const uint64_t* s, unsigned m, uint64_t* d) {
    const uint64_t* s1 = s + __builtin_popcount(m & 15);
    STORE(d, _mm256_and_si256(_mm256_permutevar8x32_epi32(LOAD(s), TABLE(lut64_unpack[m & 15])),
                              TABLE(lut64_keep[m & 15])));
    STORE(d + 4, _mm256_and_si256(_mm256_permutevar8x32_epi32(LOAD(s1), TABLE(lut64_unpack[m >> 4])),
                                  TABLE(lut64_keep[m >> 4])));
}

/* Whole rows, blocks independent (offs[b]: where block b's kept elements go). A block's stray lanes are
 * overwritten by the next block's; blocks [0, vb) are those whose 8 lanes stay inside the row's c outputs.
 * The rest (the row's last <= 7 kept elements, and a partial last block) go through a 16-element scratch,
 * so no access leaves the row: no race between threads, no read past the tensor. Bits past column n are 0. */
#define ROW_FUNCTIONS(T)                                                                                     \
    AVX2 static void compress_row_##T##_avx2(const cols_t* p, const T##_t* src, T##_t* dst) {                 \
        /* locals: dst may alias *p as far as C knows, and reloading p's fields each block halves the speed */ \
        const uint8_t* restrict bits = p->bits;                                                              \
        const int32_t* restrict offs = p->offs;                                                              \
        const int64_t vb = p->vb, nb = p->n / 8, rem = p->n % 8, base = offs[vb];                           \
        T##_t scratch[16], last[8] = {0};                                                                    \
        for (int64_t b = 0; b < vb; b++) pack_##T(src + 8 * b, bits[b], dst + offs[b]);                      \
        for (int64_t b = vb; b < nb; b++) pack_##T(src + 8 * b, bits[b], scratch + offs[b] - base);          \
        if (rem) {                                                                                           \
            memcpy(last, src + 8 * nb, (size_t)rem * sizeof(T##_t));                                         \
            pack_##T(last, bits[nb], scratch + offs[nb] - base);                                             \
        }                                                                                                    \
        memcpy(dst + base, scratch, (size_t)(p->c - base) * sizeof(T##_t));                                  \
    }                                                                                                        \
    AVX2 static void expand_row_##T##_avx2(const cols_t* p, const T##_t* src, T##_t* dst) {                   \
        const uint8_t* restrict bits = p->bits;                                                              \
        const int32_t* restrict offs = p->offs;                                                              \
        const int64_t vb = p->vb, nb = p->n / 8, rem = p->n % 8, base = offs[vb];                           \
        T##_t scratch[16] = {0}, last[8];                                                                    \
        for (int64_t b = 0; b < vb; b++) unpack_##T(src + offs[b], bits[b], dst + 8 * b);                    \
        memcpy(scratch, src + base, (size_t)(p->c - base) * sizeof(T##_t));                                  \
        for (int64_t b = vb; b < nb; b++) unpack_##T(scratch + offs[b] - base, bits[b], dst + 8 * b);        \
        if (rem) {                                                                                           \
            unpack_##T(scratch + offs[nb] - base, bits[nb], last);                                           \
            memcpy(dst + 8 * nb, last, (size_t)rem * sizeof(T##_t));                                         \
        }                                                                                                    \
    }
ROW_FUNCTIONS(u32)
ROW_FUNCTIONS(u64)
#endif

#ifdef PX_X86
#define PICK(fn) (have_avx2 ? fn##_avx2 : fn)
#else
#define PICK(fn) (fn)
#endif

/* dst row k = the kept columns of src row rows[k] (rows NULL: row k); whole rows (c = n) by memcpy. */
#define COMPRESS_ROWS(T, fn)                                                                   \
    {                                                                                          \
        void (*row_fn)(const cols_t*, const T*, T*) = PICK(fn);                                \
        const T* s = (const T*)src; T* d = (T*)dst;                                            \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")     \
        for (int64_t k = 0; k < r; k++) {                                                      \
            const T* in = s + (rows ? rows[k] : k) * p.n;                                      \
            if (p.c == p.n) memcpy(d + k * p.n, in, (size_t)p.n * sizeof(T));                  \
            else row_fn(&p, in, d + k * p.c);                                                  \
        }                                                                                      \
    }

/* dst row rows[k] = src row k spread out; the pruned rows after it, up to the next kept one, zeroed by the
 * same thread: every element of dst is written exactly once. */
#define EXPAND_ROWS(T, fn)                                                                     \
    {                                                                                          \
        void (*row_fn)(const cols_t*, const T*, T*) = PICK(fn);                                \
        const T* s = (const T*)src; T* d = (T*)dst;                                            \
        int64_t first = r == 0 ? n_rows : (rows ? rows[0] : 0);                                \
        memset(d, 0, (size_t)(first * p.n) * sizeof(T));                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")     \
        for (int64_t k = 0; k < r; k++) {                                                      \
            int64_t row = rows ? rows[k] : k;                                                  \
            int64_t next = k + 1 == r ? n_rows : (rows ? rows[k + 1] : k + 1);                 \
            if (p.c == p.n) memcpy(d + row * p.n, s + k * p.n, (size_t)p.n * sizeof(T));       \
            else row_fn(&p, s + k * p.c, d + row * p.n);                                       \
            memset(d + (row + 1) * p.n, 0, (size_t)((next - row - 1) * p.n) * sizeof(T));      \
        }                                                                                      \
    }

/* Arguments, all Python ints (pointers as addresses; validated by the caller, prunex_hvd.engine.sparsity.native):
 *   compress(src, dst, elem_size, threads, n_rows, rows, r, bits, offs, n, c, vb)
 *   expand  (src, dst, elem_size, threads, n_rows, rows, r, bits, offs, n, c, vb)
 * rows = 0: every row kept (r = n_rows). */
static PyObject* run(PyObject* const* args, Py_ssize_t nargs, int expand) {
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "maskcopy: expected 12 integer arguments");
        return NULL;
    }
    long long a[12];
    for (int i = 0; i < 12; i++) {
        a[i] = PyLong_AsLongLong(args[i]);
        if (a[i] == -1 && PyErr_Occurred()) return NULL;
    }
    void* src = (void*)(intptr_t)a[0];
    void* dst = (void*)(intptr_t)a[1];
    int64_t elem = a[2], n_rows = a[4], r = a[6];
    int threads = (int)a[3];
    const int64_t* rows = (const int64_t*)(intptr_t)a[5];
    cols_t p = {(const uint8_t*)(intptr_t)a[7], (const int32_t*)(intptr_t)a[8], a[9], a[10], a[11]};
    if (elem != 4 && elem != 8) {
        PyErr_SetString(PyExc_ValueError, "maskcopy: elements must be 4 or 8 bytes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (elem == 4) {
        if (expand) EXPAND_ROWS(u32_t, expand_row_u32) else COMPRESS_ROWS(u32_t, compress_row_u32)
    } else {
        if (expand) EXPAND_ROWS(u64_t, expand_row_u64) else COMPRESS_ROWS(u64_t, compress_row_u64)
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject* compress(PyObject* Py_UNUSED(self), PyObject* const* args, Py_ssize_t nargs) { return run(args, nargs, 0); }
static PyObject* expand(PyObject* Py_UNUSED(self), PyObject* const* args, Py_ssize_t nargs) { return run(args, nargs, 1); }
static PyObject* simd(PyObject* Py_UNUSED(self), PyObject* Py_UNUSED(unused)) { return PyUnicode_FromString(have_avx2 ? "avx2" : "scalar"); }

/* Tests: run the scalar loops on an AVX2 machine too (use_simd(False)), and back. Returns the previous state. */
static PyObject* use_simd(PyObject* Py_UNUSED(self), PyObject* flag) {
    int previous = have_avx2, on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
#ifdef PX_X86
    have_avx2 = on && __builtin_cpu_supports("avx2");
#endif
    return PyBool_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"compress", (PyCFunction)(void (*)(void))compress, METH_FASTCALL, "Pack the kept block (see maskcopy.c)."},
    {"expand", (PyCFunction)(void (*)(void))expand, METH_FASTCALL, "Spread the kept block back (see maskcopy.c)."},
    {"simd", simd, METH_NOARGS, "'avx2' or 'scalar': the loops in use."},
    {"use_simd", use_simd, METH_O, "Turn the AVX2 loops off or on (tests); returns the previous state."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_maskcopy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__maskcopy(void) {
    init_luts();
    return PyModule_Create(&module);
}
