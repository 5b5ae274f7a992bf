/* Huge pages under pymalloc's arenas (monitor/huge_pages.py says when it is used).

   pymalloc takes memory for Python's small objects in arenas of 1 MiB, each a mmap of its own.
   The kernel backs an anonymous mapping with a transparent huge page (2 MiB) only where it covers
   a whole aligned 2 MiB range, which a lone 1 MiB arena never does, so every arena is 4 KiB pages.
   At 100,000 ranks the monitor's heap is ~1.4 GiB of small objects read in no particular order,
   and in a virtual machine each TLB miss walks two page tables: a random read of a Python object
   cost ~1.5 us here (docs/scaling.md, round 18). This allocator hands pymalloc its arenas from
   chunks of CHUNK_BYTES, each aligned to 2 MiB and madvise(MADV_HUGEPAGE)d, so the kernel backs
   them with huge pages where it offers transparent huge pages (``madvise`` or ``always``).
   CPython 3.15 does the same for its own arenas (gh-144319, --with-pymalloc-hugepages).

   Transparent huge pages are a hint: where the kernel has none to give, the chunk is ordinary
   pages and nothing fails (no MAP_HUGETLB, whose exhausted pool delivers SIGBUS). Arenas of a
   size this does not serve, and any mmap that fails, go to the allocator that was installed
   before, as do the frees of arenas made before :func:`install` (they are not in a chunk). A
   chunk whose arenas are all free is unmapped, except one kept for the next arena (an arena
   freed and made again at a chunk's edge would otherwise map and fault 32 MiB each time).

   pymalloc calls these with the GIL held (Python 3.11), so nothing here takes a lock. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define CHUNK_BYTES ((size_t)32 << 20)
#define MAX_SLOTS 256 /* CHUNK_BYTES / the smallest arena served (128 KiB) */

typedef struct chunk {
    char *base;
    size_t arena; /* the arena size it serves */
    unsigned slots, used, next_free;
    unsigned char busy[MAX_SLOTS];
    struct chunk *next;
} chunk;

static PyObjectArenaAllocator previous;
static chunk *chunks;      /* chunks with arenas in use */
static chunk *spare;       /* one chunk with none, kept */
static int installed;
static unsigned long long n_mapped, n_unmapped, n_fallback, n_foreign_free;

static chunk *new_chunk(size_t arena) {
    char *raw = mmap(NULL, CHUNK_BYTES + HUGE_PAGE, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *base = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    size_t tail = (size_t)((raw + CHUNK_BYTES + HUGE_PAGE) - (base + CHUNK_BYTES));
    if (tail)
        munmap(base + CHUNK_BYTES, tail);
#ifdef MADV_HUGEPAGE
    (void)madvise(base, CHUNK_BYTES, MADV_HUGEPAGE); /* a hint: EINVAL where THP is absent */
#endif
    chunk *c = PyMem_RawCalloc(1, sizeof(chunk));
    if (c == NULL) {
        munmap(base, CHUNK_BYTES);
        return NULL;
    }
    c->base = base;
    c->arena = arena;
    c->slots = (unsigned)(CHUNK_BYTES / arena);
    n_mapped++;
    return c;
}

static void *arena_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size == 0 || size > CHUNK_BYTES || CHUNK_BYTES % size || CHUNK_BYTES / size > MAX_SLOTS)
        goto fallback;
    chunk *c = chunks;
    while (c != NULL && (c->arena != size || c->used == c->slots))
        c = c->next;
    if (c == NULL) {
        if (spare != NULL && spare->arena == size) {
            c = spare;
            spare = NULL;
        } else {
            c = new_chunk(size);
            if (c == NULL)
                goto fallback;
        }
        c->next = chunks;
        chunks = c;
    }
    for (unsigned k = 0; k < c->slots; k++) {
        unsigned i = (c->next_free + k) % c->slots;
        if (!c->busy[i]) {
            c->busy[i] = 1;
            c->used++;
            c->next_free = (i + 1) % c->slots;
            return c->base + (size_t)i * size;
        }
    }
fallback: /* not reached with a free slot: used < slots */
    n_fallback++;
    return previous.alloc(previous.ctx, size);
}

static void arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    chunk **link = &chunks;
    for (chunk *c = chunks; c != NULL; link = &c->next, c = c->next) {
        if ((char *)ptr < c->base || (char *)ptr >= c->base + CHUNK_BYTES)
            continue;
        unsigned i = (unsigned)(((char *)ptr - c->base) / c->arena);
        if (c->busy[i]) {
            c->busy[i] = 0;
            c->used--;
        }
        if (c->used == 0) { /* none in use: kept as the spare, or given back */
            *link = c->next;
            if (spare == NULL) {
                c->next = NULL;
                c->next_free = 0;
                spare = c;
            } else {
                munmap(c->base, CHUNK_BYTES);
                PyMem_RawFree(c);
                n_unmapped++;
            }
        }
        return;
    }
    n_foreign_free++; /* an arena made before install(), or by the fallback */
    previous.free(previous.ctx, ptr, size);
}

static PyObject *install(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (!installed) {
        PyObject_GetArenaAllocator(&previous);
        PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
        PyObject_SetArenaAllocator(&mine);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *stats(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    unsigned long long in_use = 0, arenas = 0;
    for (chunk *c = chunks; c != NULL; c = c->next) {
        in_use++;
        arenas += c->used;
    }
    return Py_BuildValue("{s:O,s:K,s:K,s:i,s:K,s:K,s:K,s:K,s:n}", "installed",
                         installed ? Py_True : Py_False, "chunks", in_use, "arenas", arenas,
                         "spare", spare != NULL, "chunks_mapped", n_mapped, "chunks_unmapped",
                         n_unmapped, "fallbacks", n_fallback, "foreign_frees", n_foreign_free,
                         "chunk_bytes", (Py_ssize_t)CHUNK_BYTES);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Serve pymalloc's arenas from huge-page-advised chunks from now on (once; idempotent)."},
    {"stats", stats, METH_NOARGS, "What the allocator holds and has done, as a dict."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hugearenas",
                                    "Huge pages under pymalloc's arenas.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hugearenas(void) { return PyModule_Create(&module); }
