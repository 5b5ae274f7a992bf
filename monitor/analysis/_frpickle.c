/* _frpickle: a data-only reader of Flight Recorder dump pickles (monitor/analysis/loader.py).
 *
 * Why: unpickling a dump (pickle.load: a dict per entry, its stack frames, every int and string)
 * is most of what `lightkeeper analyze` costs, yet the analysis reads a dozen fields per entry.
 * This reader parses the pickle bytes into a flat arena of nodes (no Python object per value),
 * then builds Python objects only for what is asked: the entries' wanted fields as columns
 * (Dump.columns), the dump without its entries, or the whole dump (Dump.load, equal to
 * pickle.loads). Anything it does not read is refused (DumpRefused, a ValueError) and the
 * caller takes its pure-Python path: so a value this reader returns is always what pickle.loads
 * would have given.
 *
 * A dump is untrusted input: only data opcodes of protocols 2-5 as pickle.dump and torch write
 * them are accepted (dict, list, tuple, str, bytes, int, float, bool, None, memo, frames); no
 * GLOBAL/REDUCE/BUILD/... ever runs. Every read is bounds-checked, containers nest at most
 * MAX_DEPTH deep when built, indices are 32-bit (inputs up to 1 GiB), every string is checked to
 * be UTF-8 (as pickle does) even when never built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_BYTES ((Py_ssize_t)1 << 30)
#define MAX_DEPTH 100
#define MAX_KEYS 32

enum { K_NONE, K_TRUE, K_FALSE, K_INT, K_BIGINT, K_FLOAT, K_STR, K_BYTES, K_TUPLE, K_LIST, K_DICT };

typedef struct {
    union {
        int64_t i;       /* K_INT */
        double f;        /* K_FLOAT */
        Py_ssize_t off;  /* K_STR, K_BYTES, K_BIGINT: offset of the payload in the input;
                            K_TUPLE: first item in `items`; K_LIST, K_DICT: first chunk or -1 */
    } v;
    int32_t n;       /* payload length; K_TUPLE: item count; K_LIST, K_DICT: last chunk or -1 */
    uint8_t kind;
    uint8_t shared;  /* fetched from the memo: referenced more than once, so built once (as
                        pickle does); a node only memoized is referenced once, built fresh */
    uint8_t busy;    /* a tuple being built: met again means a cycle through a tuple: refused */
} Node;

/* the items a container got from one APPENDS/SETITEMS (dicts: key, value, key, value, ...) */
typedef struct { int32_t start, count, next; } Chunk;

typedef struct {
    PyObject_HEAD
    PyObject *data;   /* the input bytes: strings are read from them when built */
    Node *nodes; Py_ssize_t n_nodes, cap_nodes;
    int32_t *items; Py_ssize_t n_items, cap_items;
    Chunk *chunks; Py_ssize_t n_chunks, cap_chunks;
    PyObject **built; /* per node: its object when shared and built (lazily allocated) */
    int32_t root;
    int broken;       /* a build failed half-way: cached objects may be incomplete */
} Dump;

static PyObject *DumpRefused;

static int refuse(const char *why) {
    PyErr_SetString(DumpRefused, why);
    return -1;
}

/* grow *arr (elem bytes each) to hold at least `need` elements */
static int grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t elem) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    if (cap2 > INT32_MAX) return refuse("too many values");
    void *p = PyMem_Realloc(*arr, (size_t)cap2 * elem);
    if (!p) { PyErr_NoMemory(); return -1; }
    *arr = p;
    *cap = cap2;
    return 0;
}

static inline int32_t new_node(Dump *d, uint8_t kind) {
    /* the capacity test inline: this runs once per value of the dump */
    if (d->n_nodes == d->cap_nodes && grow((void **)&d->nodes, &d->cap_nodes, d->n_nodes + 1, sizeof(Node)) < 0) return -1;
    Node *nd = &d->nodes[d->n_nodes];
    memset(nd, 0, sizeof(Node));
    nd->kind = kind;
    if (kind == K_LIST || kind == K_DICT) { nd->v.off = -1; nd->n = -1; }
    return (int32_t)d->n_nodes++;
}

/* copy `count` node ids to `items` as one more chunk of container `target` */
static int add_chunk(Dump *d, int32_t target, const int32_t *ids, Py_ssize_t count) {
    if (grow((void **)&d->items, &d->cap_items, d->n_items + count, sizeof(int32_t)) < 0) return -1;
    if (grow((void **)&d->chunks, &d->cap_chunks, d->n_chunks + 1, sizeof(Chunk)) < 0) return -1;
    int32_t c = (int32_t)d->n_chunks++;
    d->chunks[c] = (Chunk){(int32_t)d->n_items, (int32_t)count, -1};
    memcpy(d->items + d->n_items, ids, (size_t)count * sizeof(int32_t));
    d->n_items += count;
    Node *nd = &d->nodes[target];
    if (nd->n < 0) nd->v.off = c; else d->chunks[nd->n].next = c;
    nd->n = c;
    return 0;
}

static int is_key_kind(uint8_t kind) { return kind <= K_BYTES; }  /* hashable scalars only */

static int check_utf8(const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((unsigned char)s[i] & 0x80) {  /* not ASCII: let Python's decoder judge, as pickle */
            PyObject *u = PyUnicode_DecodeUTF8(s, n, "surrogatepass");
            if (!u) {  /* pickle's error, and message, are the Python path's to give */
                PyErr_Clear();
                return refuse("a string that is not UTF-8");
            }
            Py_DECREF(u);
            return 0;
        }
    }
    return 0;
}

static uint64_t le(const unsigned char *p, int n) {
    uint64_t x = 0;
    for (int i = n - 1; i >= 0; i--) x = (x << 8) | p[i];
    return x;
}

/* ---- pass 1: the pickle's opcodes into nodes, as pickle's own stack machine does ---------- */

typedef struct {
    int32_t *stack; Py_ssize_t sp, cap;
    Py_ssize_t *marks; Py_ssize_t n_marks, cap_marks;
    int32_t *memo; Py_ssize_t memo_cap, memo_len;
} Machine;

#define NEED(k) do { if (end - p < (Py_ssize_t)(k)) { refuse("truncated pickle"); goto fail; } } while (0)
#define FENCE (m.n_marks ? m.marks[m.n_marks - 1] : 0)
#define PUSH(id) do { int32_t id_ = (id); if (id_ < 0) goto fail; \
    if (m.sp == m.cap && grow((void **)&m.stack, &m.cap, m.sp + 1, sizeof(int32_t)) < 0) goto fail; \
    m.stack[m.sp++] = id_; } while (0)

static int memo_put(Dump *d, Machine *m, uint64_t idx, Py_ssize_t limit) {
    if (m->sp <= (m->n_marks ? m->marks[m->n_marks - 1] : 0)) return refuse("memo put on an empty stack");
    if (idx > (uint64_t)limit) return refuse("memo index out of range");  /* pickle.dump's grow by one */
    Py_ssize_t old = m->memo_cap;
    if (grow((void **)&m->memo, &m->memo_cap, (Py_ssize_t)idx + 1, sizeof(int32_t)) < 0) return -1;
    for (Py_ssize_t i = old; i < m->memo_cap; i++) m->memo[i] = -1;
    if (m->memo[idx] < 0) m->memo_len++;  /* MEMOIZE's next index, as pickle counts it */
    m->memo[idx] = m->stack[m->sp - 1];
    return 0;
}

static int pop_mark(Machine *m, Py_ssize_t *x) {
    if (!m->n_marks) return refuse("no MARK");
    *x = m->marks[--m->n_marks];
    return 0;
}

static int parse(Dump *d) {
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(d->data);
    Py_ssize_t size = PyBytes_GET_SIZE(d->data);
    const unsigned char *p = base, *end = base + size;
    Machine m = {0};
    int32_t id;
    Py_ssize_t x, len;
    uint64_t u;
    if (size > MAX_BYTES) return refuse("input too large");
    /* a dump has a value per 6 to 7 bytes of pickle: room for most up front (at most 4M nodes,
       64 MiB), since growing by copies from a small start tripled the parse's time */
    Py_ssize_t guess = size / 4 < (1 << 22) ? size / 4 + 64 : (1 << 22);
    if (grow((void **)&d->nodes, &d->cap_nodes, guess, sizeof(Node)) < 0) return -1;
    if (grow((void **)&d->items, &d->cap_items, guess, sizeof(int32_t)) < 0) return -1;
    NEED(2);
    if (p[0] != 0x80 || p[1] < 2 || p[1] > 5) { refuse("not a pickle of protocol 2 to 5"); goto fail; }
    for (;;) {
        NEED(1);
        unsigned char op = *p++;
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1);
            if (*p < 2 || *p > 5) { refuse("unsupported protocol"); goto fail; }
            p++;
            break;
        case 0x95: /* FRAME: pickle checks the frame is there; its bounds matter no further */
            NEED(8);
            u = le(p, 8);
            p += 8;
            if (u > (uint64_t)(end - p)) { refuse("truncated frame"); goto fail; }
            break;
        case '(': /* MARK */
            if (grow((void **)&m.marks, &m.cap_marks, m.n_marks + 1, sizeof(Py_ssize_t)) < 0) goto fail;
            m.marks[m.n_marks++] = m.sp;
            break;
        case '.': /* STOP: pickle returns the top of the stack */
            if (m.sp <= FENCE) { refuse("empty stack at STOP"); goto fail; }
            d->root = m.stack[m.sp - 1];
            PyMem_Free(m.stack); PyMem_Free(m.marks); PyMem_Free(m.memo);
            return 0;
        case 'N': PUSH(new_node(d, K_NONE)); break;
        case 0x88: PUSH(new_node(d, K_TRUE)); break;
        case 0x89: PUSH(new_node(d, K_FALSE)); break;
        case 'K': case 'M': case 'J': { /* BININT1, BININT2 (unsigned), BININT (signed 32) */
            int k = op == 'K' ? 1 : op == 'M' ? 2 : 4;
            NEED(k);
            int64_t v = (int64_t)le(p, k);
            if (k == 4) v = (int32_t)(uint32_t)v;
            p += k;
            PUSH(id = new_node(d, K_INT));
            d->nodes[id].v.i = v;
            break;
        }
        case 0x8a: /* LONG1: little-endian two's complement; up to 8 bytes fits an int64 */
            NEED(1);
            len = *p++;
            NEED(len);
            if (len <= 8) {
                PUSH(id = new_node(d, K_INT));
                uint64_t v = le(p, (int)len);
                if (len && len < 8 && (p[len - 1] & 0x80)) v |= ~(uint64_t)0 << (8 * len);
                d->nodes[id].v.i = (int64_t)v;
            } else {
                PUSH(id = new_node(d, K_BIGINT));
                d->nodes[id].v.off = p - base;
                d->nodes[id].n = (int32_t)len;
            }
            p += len;
            break;
        case 'G': { /* BINFLOAT: big-endian IEEE double */
            NEED(8);
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++) bits = (bits << 8) | p[i];
            p += 8;
            PUSH(id = new_node(d, K_FLOAT));
            memcpy(&d->nodes[id].v.f, &bits, 8);
            break;
        }
        case 0x8c: case 'X': case 0x8d:   /* SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 */
        case 'C': case 'B': case 0x8e: {  /* SHORT_BINBYTES, BINBYTES, BINBYTES8 */
            int k = (op == 0x8c || op == 'C') ? 1 : (op == 'X' || op == 'B') ? 4 : 8;
            NEED(k);
            u = le(p, k);
            p += k;
            if (u > (uint64_t)(end - p)) { refuse("truncated string"); goto fail; }
            int is_str = op == 0x8c || op == 'X' || op == 0x8d;
            if (is_str && check_utf8((const char *)p, (Py_ssize_t)u) < 0) goto fail;
            PUSH(id = new_node(d, is_str ? K_STR : K_BYTES));
            d->nodes[id].v.off = p - base;
            d->nodes[id].n = (int32_t)u;
            p += u;
            break;
        }
        case ')': PUSH(id = new_node(d, K_TUPLE)); break;
        case ']': PUSH(new_node(d, K_LIST)); break;
        case '}': PUSH(new_node(d, K_DICT)); break;
        case 't': case 0x85: case 0x86: case 0x87: { /* TUPLE (from MARK), TUPLE1-3 */
            if (op == 't') {
                if (pop_mark(&m, &x) < 0) goto fail;
            } else {
                x = m.sp - (op - 0x84);
                if (x < FENCE) { refuse("stack underflow"); goto fail; }
            }
            if ((id = new_node(d, K_TUPLE)) < 0) goto fail;
            Py_ssize_t start = d->n_items;
            if (grow((void **)&d->items, &d->cap_items, d->n_items + (m.sp - x), sizeof(int32_t)) < 0) goto fail;
            memcpy(d->items + start, m.stack + x, (size_t)(m.sp - x) * sizeof(int32_t));
            d->n_items += m.sp - x;
            d->nodes[id].v.off = start;
            d->nodes[id].n = (int32_t)(m.sp - x);
            m.sp = x;
            PUSH(id);
            break;
        }
        case 'a': case 'e': case 's': case 'u': { /* APPEND, APPENDS, SETITEM, SETITEMS */
            int is_dict = op == 's' || op == 'u';
            if (op == 'a' || op == 's') {
                x = m.sp - (is_dict ? 2 : 1);
            } else if (pop_mark(&m, &x) < 0) {
                goto fail;
            }
            if (x > m.sp || x <= FENCE) { refuse("stack underflow"); goto fail; }
            if (x == m.sp) break;  /* nothing to add: pickle checks nothing either */
            int32_t target = m.stack[x - 1];
            if (d->nodes[target].kind != (is_dict ? K_DICT : K_LIST)) { refuse("items added to a non-container"); goto fail; }
            if (is_dict) {
                if ((m.sp - x) % 2) { refuse("odd number of items for SETITEMS"); goto fail; }
                for (Py_ssize_t i = x; i < m.sp; i += 2)
                    if (!is_key_kind(d->nodes[m.stack[i]].kind)) { refuse("a dict key that is not a plain scalar"); goto fail; }
            }
            if (add_chunk(d, target, m.stack + x, m.sp - x) < 0) goto fail;
            m.sp = x;
            break;
        }
        case 'q': case 'r': case 0x94: /* BINPUT, LONG_BINPUT, MEMOIZE */
            if (op == 0x94) {
                u = (uint64_t)m.memo_len;
            } else {
                int k = op == 'q' ? 1 : 4;
                NEED(k);
                u = le(p, k);
                p += k;
            }
            if (memo_put(d, &m, u, size) < 0) goto fail;
            break;
        case 'h': case 'j': { /* BINGET, LONG_BINGET */
            int k = op == 'h' ? 1 : 4;
            NEED(k);
            u = le(p, k);
            p += k;
            if (u >= (uint64_t)m.memo_cap || m.memo[u] < 0) { refuse("memo value not found"); goto fail; }
            d->nodes[m.memo[u]].shared = 1;
            PUSH(m.memo[u]);
            break;
        }
        default: /* GLOBAL, REDUCE, BUILD, PERSID, text opcodes, sets, ...: the Python path's */
            PyErr_Format(DumpRefused, "opcode 0x%02x not read here", op);
            goto fail;
        }
    }
fail:
    PyMem_Free(m.stack); PyMem_Free(m.marks); PyMem_Free(m.memo);
    return -1;
}

/* ---- pass 2: Python objects for the nodes asked for ------------------------------------- */

static PyObject *build(Dump *d, int32_t id, int depth);

static Py_ssize_t count_items(Dump *d, Node *nd) {
    Py_ssize_t n = 0;
    for (int32_t c = (int32_t)nd->v.off; c >= 0; c = d->chunks[c].next) n += d->chunks[c].count;
    return n;
}

static int remember(Dump *d, int32_t id, PyObject *obj) {
    if (!d->built) {
        d->built = PyMem_Calloc((size_t)d->n_nodes, sizeof(PyObject *));
        if (!d->built) { PyErr_NoMemory(); return -1; }
    }
    Py_INCREF(obj);
    d->built[id] = obj;
    return 0;
}

static PyObject *build_new(Dump *d, int32_t id, int depth) {
    Node *nd = &d->nodes[id];
    const char *base = PyBytes_AS_STRING(d->data);
    PyObject *obj;
    Py_ssize_t i = 0;
    if (depth > MAX_DEPTH) { refuse("nested too deeply"); return NULL; }
    switch (nd->kind) {
    case K_NONE: Py_RETURN_NONE;
    case K_TRUE: Py_RETURN_TRUE;
    case K_FALSE: Py_RETURN_FALSE;
    case K_INT: return PyLong_FromLongLong(nd->v.i);
    case K_BIGINT: return _PyLong_FromByteArray((const unsigned char *)base + nd->v.off, (size_t)nd->n, 1, 1);
    case K_FLOAT: return PyFloat_FromDouble(nd->v.f);
    case K_STR: return PyUnicode_DecodeUTF8(base + nd->v.off, nd->n, "surrogatepass");
    case K_BYTES: return PyBytes_FromStringAndSize(base + nd->v.off, nd->n);
    case K_TUPLE:
        obj = PyTuple_New(nd->n);
        if (!obj) return NULL;
        nd->busy = 1;
        for (; i < nd->n; i++) {
            PyObject *item = build(d, d->items[nd->v.off + i], depth + 1);
            if (!item) { nd->busy = 0; Py_DECREF(obj); return NULL; }
            PyTuple_SET_ITEM(obj, i, item);
        }
        nd->busy = 0;
        return obj;
    case K_LIST:
        obj = PyList_New(count_items(d, nd));
        /* remembered before its items are built: an item may refer back to it (memo) */
        if (!obj || (nd->shared && remember(d, id, obj) < 0)) { Py_XDECREF(obj); return NULL; }
        for (int32_t c = (int32_t)nd->v.off; c >= 0; c = d->chunks[c].next) {
            for (int32_t j = 0; j < d->chunks[c].count; j++) {
                PyObject *item = build(d, d->items[d->chunks[c].start + j], depth + 1);
                if (!item) { Py_DECREF(obj); return NULL; }
                PyList_SET_ITEM(obj, i++, item);
            }
        }
        return obj;
    case K_DICT:
        obj = PyDict_New();
        if (!obj || (nd->shared && remember(d, id, obj) < 0)) { Py_XDECREF(obj); return NULL; }
        for (int32_t c = (int32_t)nd->v.off; c >= 0; c = d->chunks[c].next) {
            for (int32_t j = 0; j < d->chunks[c].count; j += 2) {
                PyObject *k = build(d, d->items[d->chunks[c].start + j], depth + 1);
                PyObject *v = k ? build(d, d->items[d->chunks[c].start + j + 1], depth + 1) : NULL;
                int bad = !v || PyDict_SetItem(obj, k, v) < 0;
                Py_XDECREF(k); Py_XDECREF(v);
                if (bad) { Py_DECREF(obj); return NULL; }
            }
        }
        return obj;
    }
    refuse("unknown node");
    return NULL;
}

static PyObject *build(Dump *d, int32_t id, int depth) {
    Node *nd = &d->nodes[id];
    if (!nd->shared) return build_new(d, id, depth);
    if (d->built && d->built[id]) { Py_INCREF(d->built[id]); return d->built[id]; }
    if (nd->busy) { refuse("a tuple that contains itself"); return NULL; }
    PyObject *obj = build_new(d, id, depth);
    if (obj && nd->kind != K_LIST && nd->kind != K_DICT && remember(d, id, obj) < 0) Py_CLEAR(obj);
    return obj;
}

/* a failed build may leave half-filled containers among the remembered objects: drop them all
   and refuse every later call (the caller reads the file its other way) */
static PyObject *built_or_broken(Dump *d, PyObject *obj) {
    if (!obj) {
        d->broken = 1;
        if (d->built) {
            for (Py_ssize_t i = 0; i < d->n_nodes; i++) Py_CLEAR(d->built[i]);
        }
    }
    return obj;
}

static int str_is(Dump *d, int32_t id, const char *s, Py_ssize_t n) {
    Node *nd = &d->nodes[id];
    return nd->kind == K_STR && nd->n == n && memcmp(PyBytes_AS_STRING(d->data) + nd->v.off, s, (size_t)n) == 0;
}

/* the value node of str key `s` in dict node `dict` (the last one, as a dict keeps), or -1 */
static int32_t lookup(Dump *d, int32_t dict, const char *s, Py_ssize_t n) {
    int32_t found = -1;
    for (int32_t c = (int32_t)d->nodes[dict].v.off; c >= 0; c = d->chunks[c].next)
        for (int32_t j = 0; j < d->chunks[c].count; j += 2)
            if (str_is(d, d->items[d->chunks[c].start + j], s, n)) found = d->items[d->chunks[c].start + j + 1];
    return found;
}

/* Whether two nodes would build equal values of the same types, for values that nothing else
   refers to (not shared) made of lists, tuples and scalars but floats (NaN != NaN): the
   entries' sizes, dtypes and process groups, which torch's pickler writes afresh for every
   entry. A column builds such a value once and gives the next equal one the same object:
   unobservable, since no other reference to it exists, and the analysis only reads them. */
static int same_plain(Dump *d, int32_t a, int32_t b, int depth) {
    Node *x = &d->nodes[a], *y = &d->nodes[b];
    if (a == b) return x->kind != K_FLOAT;
    if (x->kind != y->kind || depth > 8) return 0;
    switch (x->kind) {
    case K_NONE: case K_TRUE: case K_FALSE: return 1;
    case K_INT: return x->v.i == y->v.i;
    case K_STR: case K_BYTES: case K_BIGINT:
        return x->n == y->n && memcmp(PyBytes_AS_STRING(d->data) + x->v.off, PyBytes_AS_STRING(d->data) + y->v.off, (size_t)x->n) == 0;
    case K_TUPLE:
        if (x->shared || y->shared || x->n != y->n) return 0;
        for (int32_t i = 0; i < x->n; i++)
            if (!same_plain(d, d->items[x->v.off + i], d->items[y->v.off + i], depth + 1)) return 0;
        return 1;
    case K_LIST: {
        if (x->shared || y->shared) return 0;
        int32_t cx = (int32_t)x->v.off, cy = (int32_t)y->v.off, ix = 0, iy = 0;
        for (;;) {  /* the two lists' chunks may split their items differently */
            while (cx >= 0 && ix == d->chunks[cx].count) { cx = d->chunks[cx].next; ix = 0; }
            while (cy >= 0 && iy == d->chunks[cy].count) { cy = d->chunks[cy].next; iy = 0; }
            if (cx < 0 || cy < 0) return cx < 0 && cy < 0;
            if (!same_plain(d, d->items[d->chunks[cx].start + ix++], d->items[d->chunks[cy].start + iy++], depth + 1)) return 0;
        }
    }
    default: return 0;
    }
}

#define RECENT 4  /* distinct values a column remembers: groups that take turns (steady: 3) */

static int check(Dump *d) {
    return d->broken ? refuse("an earlier build failed") : 0;
}

static PyObject *Dump_load(Dump *d, PyObject *unused) {
    if (check(d) < 0) return NULL;
    return built_or_broken(d, build(d, d->root, 0));
}

/* the dump's top-level dict without its "entries" */
static PyObject *top_without_entries(Dump *d) {
    PyObject *top = PyDict_New();
    if (!top) return NULL;
    int32_t root = d->root;
    for (int32_t c = (int32_t)d->nodes[root].v.off; c >= 0; c = d->chunks[c].next) {
        for (int32_t j = 0; j < d->chunks[c].count; j += 2) {
            int32_t kid = d->items[d->chunks[c].start + j];
            if (str_is(d, kid, "entries", 7)) continue;
            PyObject *k = build(d, kid, 1);
            PyObject *v = k ? build(d, d->items[d->chunks[c].start + j + 1], 1) : NULL;
            int bad = !v || PyDict_SetItem(top, k, v) < 0;
            Py_XDECREF(k); Py_XDECREF(v);
            if (bad) { Py_DECREF(top); return NULL; }
        }
    }
    return top;
}

/* Dump.columns(keys, optional): the entries' fields by columns, as
   list(zip(*map(itemgetter(*keys), entries))) gives them: (top, columns, first, last) with
   `top` the dump without "entries", `columns` one tuple per key (plus one for `optional` when
   every entry has it), `first` and `last` the first and last entries whole. None when the
   dump is not of that shape: not a dict, "entries" missing, not a list or empty, an entry
   that is not a dict or lacks a key, `optional` in some entries only. */
static PyObject *Dump_columns(Dump *d, PyObject *args) {
    PyObject *keys, *optional;
    if (!PyArg_ParseTuple(args, "O!U", &PyTuple_Type, &keys, &optional)) return NULL;
    if (check(d) < 0) return NULL;
    Py_ssize_t nk = PyTuple_GET_SIZE(keys);
    if (nk < 1 || nk >= MAX_KEYS) { PyErr_SetString(PyExc_ValueError, "1 to 31 keys"); return NULL; }
    const char *want[MAX_KEYS];
    Py_ssize_t want_len[MAX_KEYS];
    for (Py_ssize_t k = 0; k <= nk; k++) {
        PyObject *key = k < nk ? PyTuple_GET_ITEM(keys, k) : optional;
        if (!PyUnicode_Check(key)) { PyErr_SetString(PyExc_TypeError, "keys must be str"); return NULL; }
        if (!(want[k] = PyUnicode_AsUTF8AndSize(key, &want_len[k]))) return NULL;
    }
    if (d->nodes[d->root].kind != K_DICT) Py_RETURN_NONE;
    int32_t list = lookup(d, d->root, "entries", 7);
    if (list < 0 || d->nodes[list].kind != K_LIST) Py_RETURN_NONE;
    Py_ssize_t n = count_items(d, &d->nodes[list]);
    if (n == 0) Py_RETURN_NONE;

    /* first walk: every entry's value nodes, in a table of n rows of nk + 1 (no object yet) */
    int32_t *cells = PyMem_Malloc((size_t)n * (size_t)(nk + 1) * sizeof(int32_t));
    if (!cells) return PyErr_NoMemory();
    int32_t seen_id[64], entry_first = -1, entry_last = -1;
    int8_t seen_slot[64];  /* key node -> wanted slot (-1: not wanted), by node id mod 64: keys
                              are memoized, so an entry's keys are the same few nodes */
    memset(seen_id, 0xff, sizeof(seen_id));
    Py_ssize_t row = 0, with_optional = 0;
    PyObject *result = Py_None;
    Py_INCREF(result);
    for (int32_t c = (int32_t)d->nodes[list].v.off; c >= 0; c = d->chunks[c].next) {
        for (int32_t j = 0; j < d->chunks[c].count; j++, row++) {
            int32_t entry = d->items[d->chunks[c].start + j];
            if (d->nodes[entry].kind != K_DICT) goto done;
            if (row == 0) entry_first = entry;
            entry_last = entry;
            int32_t *cell = cells + row * (nk + 1);
            for (Py_ssize_t k = 0; k <= nk; k++) cell[k] = -1;
            for (int32_t e = (int32_t)d->nodes[entry].v.off; e >= 0; e = d->chunks[e].next) {
                for (int32_t q = 0; q < d->chunks[e].count; q += 2) {
                    int32_t kid = d->items[d->chunks[e].start + q];
                    int slot;
                    if (seen_id[kid & 63] == kid) {
                        slot = seen_slot[kid & 63];
                    } else {
                        slot = -1;
                        for (Py_ssize_t k = 0; k <= nk && slot < 0; k++)
                            if (str_is(d, kid, want[k], want_len[k])) slot = (int)k;
                        seen_id[kid & 63] = kid;
                        seen_slot[kid & 63] = (int8_t)slot;
                    }
                    if (slot >= 0) cell[slot] = d->items[d->chunks[e].start + q + 1];
                }
            }
            for (Py_ssize_t k = 0; k < nk; k++)
                if (cell[k] < 0) goto done;
            with_optional += cell[nk] >= 0;
        }
    }
    if (with_optional != 0 && with_optional != n) goto done;

    /* second walk: the objects, column by column */
    Py_ssize_t ncols = nk + (with_optional ? 1 : 0);
    PyObject *cols = PyTuple_New(ncols);
    if (!cols) goto error;
    for (Py_ssize_t k = 0; k < ncols; k++) {
        PyObject *col = PyTuple_New(n);
        if (!col) { Py_DECREF(cols); goto error; }
        PyTuple_SET_ITEM(cols, k, col);
        int32_t recent_id[RECENT];
        PyObject *recent[RECENT];  /* borrowed: the column holds them */
        int n_recent = 0, next_slot = 0;
        for (Py_ssize_t r = 0; r < n; r++) {
            int32_t id = cells[r * (nk + 1) + k];
            Node *nd = &d->nodes[id];
            PyObject *v = NULL;
            int plain = (nd->kind == K_LIST || nd->kind == K_TUPLE) && !nd->shared;
            for (int i = 0; plain && i < n_recent && !v; i++)
                if (same_plain(d, recent_id[i], id, 0)) v = Py_NewRef(recent[i]);
            if (!v) {
                if (!(v = build(d, id, 1))) { Py_DECREF(cols); goto error; }
                if (plain) {
                    recent_id[next_slot] = id;
                    recent[next_slot] = v;
                    next_slot = (next_slot + 1) % RECENT;
                    if (n_recent < RECENT) n_recent++;
                }
            }
            PyTuple_SET_ITEM(col, r, v);
        }
    }
    PyObject *top = top_without_entries(d);
    PyObject *first = top ? build(d, entry_first, 1) : NULL;
    PyObject *last = first ? build(d, entry_last, 1) : NULL;
    if (!last) { Py_XDECREF(top); Py_XDECREF(first); Py_DECREF(cols); goto error; }
    Py_DECREF(result);
    result = Py_BuildValue("(NNNN)", top, cols, first, last);
    if (!result) goto error;
done:
    PyMem_Free(cells);
    return result;
error:
    PyMem_Free(cells);
    Py_XDECREF(result);
    return built_or_broken(d, NULL);
}

static void Dump_dealloc(Dump *d) {
    if (d->built) {
        for (Py_ssize_t i = 0; i < d->n_nodes; i++) Py_XDECREF(d->built[i]);
        PyMem_Free(d->built);
    }
    PyMem_Free(d->nodes);
    PyMem_Free(d->items);
    PyMem_Free(d->chunks);
    Py_XDECREF(d->data);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyMethodDef Dump_methods[] = {
    {"load", (PyCFunction)Dump_load, METH_NOARGS, "The whole dump, equal to pickle.loads of the input."},
    {"columns", (PyCFunction)Dump_columns, METH_VARARGS,
     "columns(keys, optional) -> (top, columns, first, last) or None: the entries' fields by columns."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DumpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "monitor.analysis._frpickle.Dump",
    .tp_basicsize = sizeof(Dump),
    .tp_dealloc = (destructor)Dump_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A parsed dump pickle (from parse()): nothing is built until asked for.",
    .tp_methods = Dump_methods,
};

static PyObject *frpickle_parse(PyObject *module, PyObject *data) {
    if (!PyBytes_Check(data)) { PyErr_SetString(PyExc_TypeError, "parse() takes bytes"); return NULL; }
    Dump *d = PyObject_New(Dump, &DumpType);
    if (!d) return NULL;
    d->data = Py_NewRef(data);
    d->nodes = NULL; d->items = NULL; d->chunks = NULL; d->built = NULL;
    d->n_nodes = d->cap_nodes = d->n_items = d->cap_items = d->n_chunks = d->cap_chunks = 0;
    d->root = -1;
    d->broken = 0;
    if (parse(d) < 0) { Py_DECREF(d); return NULL; }
    return (PyObject *)d;
}

static PyMethodDef module_methods[] = {
    {"parse", frpickle_parse, METH_O,
     "parse(data: bytes) -> Dump; raises DumpRefused for anything it does not read."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_frpickle",
    "A data-only reader of Flight Recorder dump pickles that builds only the columns asked for.",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__frpickle(void) {
    if (PyType_Ready(&DumpType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    DumpRefused = PyErr_NewException("monitor.analysis._frpickle.DumpRefused", PyExc_ValueError, NULL);
    if (!DumpRefused || PyModule_AddObjectRef(m, "DumpRefused", DumpRefused) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
