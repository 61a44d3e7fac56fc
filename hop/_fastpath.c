/* hop._fastpath: the steady-state eager call of hop.cond and hop.switch in C.

Note [the eager inline cache]
A plain eager cond/switch whose signature is validated runs one branch and then
checks what Python checks (hop/ops/branching/_call_cache.py holds the same function in Python,
used where this module is not built, and is the reference for it). Written in
Python, the checks alone cost about a Python `if` (every tensor attribute read is
~45 ns through the interpreter): this module makes them a few struct reads.

An entry of the inline cache is made by Python (hop.ops.branching._call_cache.remember) after a
call found its verdict; it is keyed by a fold of the addresses of the branches'
code (a builtin's own address) and the operand's dtype, rank and device, and is a
hop.ops.branching._call_cache.Entry (a NamedTuple, read here by position; configure() checks
that its fields are ENTRY_FIELDS, in order):

    (items, dtype, ndim, device, kinds, usual, names, key)

items: per branch its code object (a plain function) or the builtin itself (only a
builtin whose owner is inert, as torch.tanh: an entry keeps what it holds alive);
dtype/ndim/device: the operand's kind the verdict is for; kinds: the verdict's set
of output kinds; usual: one of them (None if there is none), compared first without
building a tuple; names: per branch the globals its code loads (None for a
builtin); key: the verdict's key. Whether a branch can read a tensor but its
argument is decided again on every call that needs it, from each function's
defaults and the current values of those globals (hop._closures.is_inert; a
module or class that Python has not found to be a library's sends the call to
Python, which searches the attributes the code names): the entry holds no value
that could change.

Threads: reading the selector may release the GIL, and another thread may then
empty the cache; so the selector is read first, and an entry is held by a strong
reference from the moment it is found.

cond() and switch() return the result, NOT_TAKEN (nothing ran: Python takes over), or
(out, k, entry): branch k ran and returned out, which Python must finish (a new
output kind, zero gradients to attach, an alias to clone). Nothing here raises
but what the branch or reading the selector raises; a selector that cannot be
read as Python reads it (meta, several elements) is a NOT_TAKEN, and Python explains it.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *Tensor;         /* torch.Tensor */
static PyObject *NOT_TAKEN;           /* hop.ops.branching._call_cache.NOT_TAKEN */
static PyObject *config;         /* the hop.config module's __dict__ */
static PyObject *reference;      /* the hop._reference module's __dict__ (ACTIVE: threads in reference()) */
static PyObject *sinks;          /* hop.debug.SINKS (a list) */
static PyObject *once;           /* "once" */
static PyObject *index_dtypes;   /* switch's integer dtypes (a set) */
static PyObject *cond_cache;     /* dict: key (see find) -> entry */
static PyObject *switch_cache;
static PyObject *mode_stack_len; /* torch._C._len_torch_dispatch_stack */
static PyObject *functorch_level;/* torch._C._functorch.maybe_current_level */
static PyObject *tf_mode;        /* torch._C._is_torch_function_mode_enabled */
static PyObject *grad_enabled;   /* torch.is_grad_enabled */
static PyObject *inert_types;    /* hop._closures.INERT_TYPES (a frozenset) */
static PyObject *library_namespaces; /* hop._closures.LIBRARY_NAMESPACES (a set, Python fills it) */
static PyObject *accumulate_grad;/* the type of a leaf's AccumulateGrad node */
static PyObject *s_dtype, *s_ndim, *s_get_device, *s_requires_grad, *s_is_view, *s_validate, *s_active;
static PyObject *s_grad_fn, *s_next_functions, *s_variable;

enum { E_ITEMS, E_DTYPE, E_NDIM, E_DEVICE, E_KINDS, E_USUAL, E_NAMES, E_KEY, E_SIZE };
static const char *ENTRY_FIELDS[E_SIZE] = {"items", "dtype", "ndim", "device", "kinds", "usual", "names", "key"};

/* 1 when no dispatch mode, no functorch transform and no torch-function mode is
   active (hop._transforms.nothing_active), 0 otherwise, -1 on error. The cache
   serves only then, not in all of plain eager (Note [plain eager]): under user modes
   Python serves the call, reading the selector once, as a Python `if` does (here a
   read that finds no entry would be a second one). */
static int
nothing_active(void)
{
    PyObject *r = PyObject_CallNoArgs(mode_stack_len);
    if (r == NULL)
        return -1;
    int none = PyLong_Check(r) && PyLong_AsLong(r) == 0;
    Py_DECREF(r);
    if (!none)
        return PyErr_Occurred() ? -1 : 0;
    r = PyObject_CallNoArgs(functorch_level);
    if (r == NULL)
        return -1;
    none = r == Py_None;
    Py_DECREF(r);
    if (!none)
        return 0;
    r = PyObject_CallNoArgs(tf_mode);
    if (r == NULL)
        return -1;
    none = r == Py_False;
    Py_DECREF(r);
    return none;
}

/* nothing_active(): the C module's answer, for the test that asks every path */
static PyObject *
fast_nothing_active(PyObject *self, PyObject *unused)
{
    int yes = nothing_active();
    if (yes < 0)
        return NULL;
    return PyBool_FromLong(yes);
}

/* 1 when hop.config.validate is "once", no hop.debug sink is installed and no
   thread is inside hop.testing.reference() (each makes Python take the call), 0
   otherwise, -1 on error. */
static int
validate_once(void)
{
    PyObject *v = PyDict_GetItemWithError(config, s_validate); /* borrowed */
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (v != once && !(PyUnicode_CheckExact(v) && PyUnicode_Compare(v, once) == 0))
        return 0; /* an equal string not interned (read from a file, say) is "once" too */
    if (PyList_GET_SIZE(sinks) != 0)
        return 0;
    v = PyDict_GetItemWithError(reference, s_active);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyLong_CheckExact(v) && PyLong_AsLong(v) == 0;
}

/* An int attribute or method result of t, -1 with an error set on failure. */
static long
int_of(PyObject *t, PyObject *name, int method, int *err)
{
    PyObject *v = method ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
    if (v == NULL) {
        *err = 1;
        return -1;
    }
    long n = PyLong_AsLong(v);
    Py_DECREF(v);
    if (n == -1 && PyErr_Occurred())
        *err = 1;
    return n;
}

/* 1 when t's attribute (or, with method, its method's result) is truthy, 0 if not, -1 on error. */
static int
truth_of(PyObject *t, PyObject *name, int method)
{
    PyObject *v = method ? PyObject_CallMethodNoArgs(t, name) : PyObject_GetAttr(t, name);
    if (v == NULL)
        return -1;
    int yes = PyObject_IsTrue(v);
    Py_DECREF(v);
    return yes;
}

/* 1 when v can lead to no tensor (hop._closures.is_inert, the same): an inert
   type's value, a class, or a builtin whose owner is one. Runs no Python code. */
static int
is_inert(PyObject *v)
{
    if (v == Py_None || PyType_Check(v))
        return 1;
    int yes = PySet_Contains(inert_types, (PyObject *)Py_TYPE(v));
    if (yes != 0 || !Py_IS_TYPE(v, &PyCFunction_Type))
        return yes > 0;
    PyObject *owner = PyCFunction_GET_SELF(v);
    return owner == NULL || owner == Py_None || PyType_Check(owner) ||
           PySet_Contains(inert_types, (PyObject *)Py_TYPE(owner)) > 0;
}

/* What identifies a branch in an entry: a plain function's code, a builtin itself;
   NULL for anything else (never cached). Python caches only inert builtins, so a
   builtin bound to a tensor finds no entry. */
static PyObject *
item_of(PyObject *fn)
{
    if (Py_IS_TYPE(fn, &PyFunction_Type))
        return PyFunction_GET_CLOSURE(fn) == NULL ? PyFunction_GET_CODE(fn) : NULL;
    return Py_IS_TYPE(fn, &PyCFunction_Type) ? fn : NULL;
}

#define FOLD(h, v) (((h) * 1000003ULL) ^ (unsigned long long)(v))

/* 1 when fns[:n] are the entry's branches. */
static int
same_branches(PyObject *e, PyObject *const *fns, Py_ssize_t n)
{
    PyObject *items = PyTuple_GET_ITEM(e, E_ITEMS);
    if (PyTuple_GET_SIZE(items) != n)
        return 0;
    for (Py_ssize_t j = 0; j < n; j++)
        if (item_of(fns[j]) != PyTuple_GET_ITEM(items, j))
            return 0;
    return 1;
}

/* Fold x's dtype, rank and device into h (and give them); -1 with an error set on failure. */
static int
fold_kind(PyObject *x, unsigned long long *h, PyObject **dtype_out, long *ndim_out, long *device_out)
{
    PyObject *dtype = PyObject_GetAttr(x, s_dtype);
    if (dtype == NULL)
        return -1;
    Py_DECREF(dtype); /* torch keeps its dtypes for its lifetime: the address stays valid */
    int err = 0;
    long ndim = int_of(x, s_ndim, 0, &err);
    long device = err ? -1 : int_of(x, s_get_device, 1, &err);
    if (err)
        return -1;
    *h = FOLD(FOLD(FOLD(*h, (uintptr_t)dtype), (long long)ndim), (long long)device);
    if (dtype_out != NULL) {
        *dtype_out = dtype;
        *ndim_out = ndim;
        *device_out = device;
    }
    return 0;
}

/* The entry for these branches and this operand, a new reference; NULL with no
   error set when it does not take the call, NULL with an error set on failure. Its key (key() gives it to
   Python) folds the addresses of the branches' items and the operand's kind. */
static PyObject *
find(PyObject *cache, PyObject *const *fns, Py_ssize_t n, PyObject *x)
{
    unsigned long long h = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = item_of(fns[j]);
        if (item == NULL)
            return NULL;
        h = FOLD(h, (uintptr_t)item);
    }
    PyObject *dtype;
    long ndim, device;
    if (fold_kind(x, &h, &dtype, &ndim, &device) < 0)
        return NULL;
    PyObject *id = PyLong_FromUnsignedLongLong(h);
    if (id == NULL)
        return NULL;
    PyObject *e = PyDict_GetItemWithError(cache, id);
    Py_DECREF(id);
    if (e == NULL || !PyTuple_Check(e) || PyTuple_GET_SIZE(e) != E_SIZE)
        return NULL;
    if (PyTuple_GET_ITEM(e, E_DTYPE) != dtype || PyLong_AsLong(PyTuple_GET_ITEM(e, E_NDIM)) != ndim ||
        PyLong_AsLong(PyTuple_GET_ITEM(e, E_DEVICE)) != device)
        return NULL;
    if (!same_branches(e, fns, n))
        return NULL;
    return Py_NewRef(e);
}

/* 1 when an output of this kind was validated, 0 when not, -1 on error. */
static int
known_kind(PyObject *out, PyObject *kinds, PyObject *usual)
{
    if (!Py_IS_TYPE(out, (PyTypeObject *)Tensor))
        return 0;
    PyObject *dtype = PyObject_GetAttr(out, s_dtype);
    if (dtype == NULL)
        return -1;
    Py_DECREF(dtype); /* torch keeps its dtypes for its lifetime */
    int err = 0;
    long ndim = int_of(out, s_ndim, 0, &err);
    long device = err ? -1 : int_of(out, s_get_device, 1, &err);
    if (err)
        return -1;
    if (usual != Py_None && PyTuple_GET_ITEM(usual, 0) == dtype &&
        PyLong_AsLong(PyTuple_GET_ITEM(usual, 1)) == ndim && PyLong_AsLong(PyTuple_GET_ITEM(usual, 2)) == device)
        return 1;
    PyObject *kind = Py_BuildValue("(Oll)", dtype, ndim, device);
    if (kind == NULL)
        return -1;
    int yes = PySet_Contains(kinds, kind);
    Py_DECREF(kind);
    return yes;
}

/* 1 when no branch can read a tensor but its argument (hop.ops.branching._untaken_grads.
   reads_nothing of each, the same: Note [untaken branches get zero gradients]),
   0 when Python must decide, -1 on error. */
static int
still_plain(PyObject *e, PyObject *const *fns, Py_ssize_t n)
{
    PyObject *names = PyTuple_GET_ITEM(e, E_NAMES);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *fn = fns[j];
        if (!Py_IS_TYPE(fn, &PyFunction_Type))
            continue; /* an entry's builtins are inert */
        PyObject *d = PyFunction_GET_DEFAULTS(fn), *kw = PyFunction_GET_KW_DEFAULTS(fn);
        if ((d != NULL && PyTuple_GET_SIZE(d) != 0) || (kw != NULL && PyDict_GET_SIZE(kw) != 0))
            return 0;
        PyObject *globals = PyFunction_GET_GLOBALS(fn), *loaded = PyTuple_GET_ITEM(names, j);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(loaded); i++) {
            PyObject *v = PyDict_GetItemWithError(globals, PyTuple_GET_ITEM(loaded, i));
            if (v == NULL && PyErr_Occurred())
                return -1;
            if (v != NULL && !is_inert(v))
                return 0;
            /* a module or class not known as a library's may hold a parameter under an
               attribute the code names (hop._closures.held_attributes): Python decides */
            if (v != NULL && (PyModule_Check(v) || PyType_Check(v)) && PySet_Contains(library_namespaces, v) <= 0)
                return PyErr_Occurred() ? -1 : 0;
        }
    }
    return 1;
}

/* 1 when out's autograd graph reaches x within REACH nodes, visited breadth first
   from out.grad_fn (hop.ops.branching._call_cache.reaches, the same): then x gets its gradient
   from the branch that ran and no zero-gradient node is needed (Note [untaken
   branches get zero gradients]); 0 if not, -1 on error. */
#define REACH 8
static int
reaches(PyObject *out, PyObject *x)
{
    PyObject *queue[REACH];
    Py_ssize_t len = 0, i = 0;
    int found = 0;
    PyObject *target = PyObject_GetAttr(x, s_grad_fn); /* None for a leaf: its AccumulateGrad holds it */
    if (target == NULL)
        return -1;
    PyObject *fn = PyObject_GetAttr(out, s_grad_fn);
    if (fn == NULL) {
        Py_DECREF(target);
        return -1;
    }
    if (fn == Py_None)
        Py_DECREF(fn);
    else
        queue[len++] = fn;
    while (i < len && found == 0) {
        PyObject *node = queue[i++];
        if (target != Py_None && node == target) {
            found = 1;
            break;
        }
        if ((PyObject *)Py_TYPE(node) == accumulate_grad) {
            PyObject *v = PyObject_GetAttr(node, s_variable);
            if (v == NULL) {
                found = -1;
                break;
            }
            found = v == x;
            Py_DECREF(v);
            continue;
        }
        PyObject *next = PyObject_GetAttr(node, s_next_functions);
        if (next == NULL) {
            found = -1;
            break;
        }
        if (PyTuple_Check(next)) {
            for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(next) && len < REACH; j++) {
                PyObject *pair = PyTuple_GET_ITEM(next, j);
                PyObject *n = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) > 0 ? PyTuple_GET_ITEM(pair, 0) : Py_None;
                if (n != Py_None)
                    queue[len++] = Py_NewRef(n);
            }
        }
        Py_DECREF(next);
    }
    for (Py_ssize_t j = 0; j < len; j++)
        Py_DECREF(queue[j]);
    Py_DECREF(target);
    return found;
}

/* fns[k](x) for the entry e found for this call (a reference run() takes over):
   the result, or (out, k, e) when Python must finish it. fns are the items of seq when it is not NULL (switch's
   list, which the branch may change: it is read again after). */
static PyObject *
run(PyObject *e, PyObject *seq, PyObject *const *fns, Py_ssize_t n, Py_ssize_t k, PyObject *x)
{
    PyObject *fn = fns[k]; /* e: a new reference, taken over */
    Py_INCREF(fn);
    Py_XINCREF(seq);
    PyObject *out = PyObject_CallOneArg(fn, x);
    Py_DECREF(fn);
    if (out == NULL) {
        Py_XDECREF(seq);
        Py_DECREF(e);
        return NULL;
    }
    int done = 1;
    if (seq != NULL) {
        fns = PySequence_Fast_ITEMS(seq);
        done = PySequence_Fast_GET_SIZE(seq) == n && same_branches(e, fns, n);
    }
    if (done)
        done = known_kind(out, PyTuple_GET_ITEM(e, E_KINDS), PyTuple_GET_ITEM(e, E_USUAL));
    if (done > 0 && out == x)
        done = 0;
    else if (done > 0) {
        int view = truth_of(out, s_is_view, 1);
        done = view < 0 ? -1 : !view;
    }
    if (done > 0) {
        int needs_grad = truth_of(x, s_requires_grad, 0);
        int plain = needs_grad < 0 ? -1 : still_plain(e, fns, n);
        if (needs_grad < 0 || plain < 0)
            done = -1;
        else if (needs_grad || !plain) {
            PyObject *g = PyObject_CallNoArgs(grad_enabled);
            if (g == NULL)
                done = -1;
            else if (g == Py_True)
                /* only x can need a gradient, and the graph gives it one: no node */
                done = needs_grad && plain ? reaches(out, x) : 0;
            Py_XDECREF(g);
        }
    }
    Py_XDECREF(seq);
    if (done != 0) {
        Py_DECREF(e);
        if (done > 0)
            return out;
        Py_DECREF(out);
        return NULL;
    }
    return Py_BuildValue("(NnN)", out, k, e);
}

/* key(branches, x): the key find() looks an entry up by, None for branches never cached. */
static PyObject *
fast_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !(PyList_CheckExact(args[0]) || PyTuple_CheckExact(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "key(branches, x) takes a list or tuple and a tensor");
        return NULL;
    }
    PyObject *const *fns = PySequence_Fast_ITEMS(args[0]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
    unsigned long long h = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = item_of(fns[j]);
        /* a builtin that is not inert is never cached (find() skips this check: no
           entry holds one) */
        if (item == NULL || (Py_IS_TYPE(item, &PyCFunction_Type) && !is_inert(item)))
            Py_RETURN_NONE;
        h = FOLD(h, (uintptr_t)item);
    }
    if (fold_kind(args[1], &h, NULL, NULL, NULL) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(h);
}

/* The errors reading a selector that Python's fast path also leaves to the general path. */
static int
unreadable(int value_error_too)
{
    if (PyErr_ExceptionMatches(PyExc_RuntimeError) || PyErr_ExceptionMatches(PyExc_NotImplementedError) ||
        (value_error_too && PyErr_ExceptionMatches(PyExc_ValueError))) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

static PyObject *
not_taken(void)
{
    return Py_NewRef(NOT_TAKEN);
}

/* The one operand of a call the cache may serve (the selector and the operand plain
   tensors, nothing active, validate "once"), borrowed; NULL otherwise, with an
   error set on failure. */
static PyObject *
served_operand(PyObject *selector, PyObject *ops)
{
    if (Tensor == NULL || !Py_IS_TYPE(selector, (PyTypeObject *)Tensor) || !PyTuple_CheckExact(ops) ||
        PyTuple_GET_SIZE(ops) != 1)
        return NULL;
    PyObject *x = PyTuple_GET_ITEM(ops, 0);
    if (!Py_IS_TYPE(x, (PyTypeObject *)Tensor))
        return NULL;
    int ok = validate_once();
    if (ok > 0)
        ok = nothing_active();
    return ok > 0 ? x : NULL;
}

/* cond(pred, true_fn, false_fn, operands) */
static PyObject *
fast_cond(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *x = nargs == 4 ? served_operand(args[0], args[3]) : NULL;
    if (x == NULL)
        return PyErr_Occurred() ? NULL : not_taken();
    int truth = PyObject_IsTrue(args[0]); /* may release the GIL: before find() */
    if (truth < 0)
        return unreadable(0) ? not_taken() : NULL;
    PyObject *e = find(cond_cache, args + 1, 2, x);
    if (e == NULL)
        return PyErr_Occurred() ? NULL : not_taken();
    return run(e, NULL, args + 1, 2, truth ? 0 : 1, x);
}

/* switch(index, branches, operands) */
static PyObject *
fast_switch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !(PyList_CheckExact(args[1]) || PyTuple_CheckExact(args[1])))
        return not_taken();
    PyObject *index = args[0], *branches = args[1];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(branches);
    PyObject *x = n > 0 ? served_operand(index, args[2]) : NULL;
    if (x == NULL)
        return PyErr_Occurred() ? NULL : not_taken();
    int ok;
    PyObject *dtype = PyObject_GetAttr(index, s_dtype);
    if (dtype == NULL)
        return NULL;
    ok = PySet_Contains(index_dtypes, dtype);
    Py_DECREF(dtype);
    if (ok <= 0)
        return ok < 0 ? NULL : not_taken();
    PyObject *number = PyNumber_Long(index); /* may release the GIL: before the list is read */
    if (number == NULL)
        return unreadable(1) ? not_taken() : NULL;
    int overflow = 0;
    long k = PyLong_AsLongAndOverflow(number, &overflow);
    Py_DECREF(number);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    n = PySequence_Fast_GET_SIZE(branches); /* another thread may have changed the list */
    if (overflow || k < 0 || k >= n)
        return not_taken(); /* out of range: Python raises */
    PyObject *const *fns = PySequence_Fast_ITEMS(branches); /* valid until Python code runs */
    PyObject *e = find(switch_cache, fns, n, x);
    if (e == NULL)
        return PyErr_Occurred() ? NULL : not_taken();
    return run(e, branches, fns, n, (Py_ssize_t)k, x);
}

static PyObject *
configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"entry_fields", "tensor",         "not_taken",            "config",  "reference",
                            "sinks",        "index_dtypes",   "inert_types",     "cond_cache",
                            "switch_cache", "mode_stack_len", "functorch_level", "tf_mode", "grad_enabled",
                            "accumulate_grad", "library_namespaces", NULL};
    PyObject *v[15], *fields;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!OO!O!O!O!O!O!O!OOOOO!O!", names, &PyTuple_Type, &fields,
                                     &PyType_Type, &v[0], &v[1], &PyDict_Type, &v[2], &PyDict_Type, &v[3],
                                     &PyList_Type, &v[4], &PySet_Type, &v[5], &PyFrozenSet_Type, &v[6], &PyDict_Type,
                                     &v[7], &PyDict_Type, &v[8], &v[9], &v[10], &v[11], &v[12], &PyType_Type, &v[13],
                                     &PySet_Type, &v[14]))
        return NULL;
    /* the entry's layout is Python's: refuse to run on another */
    int same = PyTuple_GET_SIZE(fields) == E_SIZE;
    for (Py_ssize_t j = 0; same && j < E_SIZE; j++) {
        PyObject *f = PyTuple_GET_ITEM(fields, j);
        same = PyUnicode_Check(f) && PyUnicode_CompareWithASCIIString(f, ENTRY_FIELDS[j]) == 0;
    }
    if (!same) {
        PyErr_Format(PyExc_RuntimeError,
                     "hop._fastpath reads entries as (items, dtype, ndim, device, kinds, usual, names, key), "
                     "but hop.ops.branching._call_cache.Entry has the fields %R: rebuild the extension (pip install -e .)",
                     fields);
        return NULL;
    }
    PyObject **slots[] = {&Tensor,         &NOT_TAKEN,         &config,   &reference,    &sinks,
                          &index_dtypes,   &inert_types,  &cond_cache, &switch_cache, &mode_stack_len,
                          &functorch_level, &tf_mode,     &grad_enabled, &accumulate_grad, &library_namespaces};
    for (int j = 0; j < 15; j++)
        Py_XSETREF(*slots[j], Py_NewRef(v[j]));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Give the module what it reads (hop.ops.branching._call_cache does, once)."},
    {"key", (PyCFunction)(void (*)(void))fast_key, METH_FASTCALL,
     "key(branches, x): the key of the entry for these branches and this operand (None: never cached)."},
    {"cond", (PyCFunction)(void (*)(void))fast_cond, METH_FASTCALL,
     "cond(pred, true_fn, false_fn, operands): the result, NOT_TAKEN, or (out, k, entry) for Python to finish."},
    {"switch", (PyCFunction)(void (*)(void))fast_switch, METH_FASTCALL,
     "switch(index, branches, operands): the result, NOT_TAKEN, or (out, k, entry) for Python to finish."},
    {"nothing_active", (PyCFunction)fast_nothing_active, METH_NOARGS,
     "nothing_active(): whether the module may serve a call now (hop._transforms.nothing_active)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "hop._fastpath",
    .m_doc = "The steady-state eager call of hop.cond and hop.switch (Note [the eager inline cache]).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    once = PyUnicode_InternFromString("once");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_ndim = PyUnicode_InternFromString("ndim");
    s_get_device = PyUnicode_InternFromString("get_device");
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    s_is_view = PyUnicode_InternFromString("_is_view");
    s_validate = PyUnicode_InternFromString("validate");
    s_active = PyUnicode_InternFromString("ACTIVE");
    s_grad_fn = PyUnicode_InternFromString("grad_fn");
    s_next_functions = PyUnicode_InternFromString("next_functions");
    s_variable = PyUnicode_InternFromString("variable");
    if (!once || !s_dtype || !s_ndim || !s_get_device || !s_requires_grad || !s_is_view || !s_validate || !s_active ||
        !s_grad_fn || !s_next_functions || !s_variable)
        return NULL;
    return PyModule_Create(&module);
}
