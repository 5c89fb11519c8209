/* The interpreter's evaluation loop for one float type, included by interp.c with
 *   T    float or double     SUF   f32 or f64     M(fn)   the libm function for T (expf / exp)
 */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SUF)

/* NumPy's float floor_divide and remainder (npy_divmod): the remainder takes the divisor's
 * sign, the quotient is snapped to the nearest integer; by zero, a / b and fmod's NaN. */
static inline T FN(float_divmod)(T a, T b, T *modulus)
{
    T mod = M(fmod)(a, b);
    if (!b) {
        *modulus = mod;
        return a / b;
    }
    T div = (a - mod) / b;
    if (mod) {
        if ((b < 0) != (mod < 0)) {
            mod += b;
            div -= 1;
        }
    } else {
        mod = M(copysign)(0, b);
    }
    T floordiv;
    if (div) {
        floordiv = M(floor)(div);
        if (div - floordiv > (T)0.5)
            floordiv += 1;
    } else {
        floordiv = M(copysign)(0, a / b);
    }
    *modulus = mod;
    return floordiv;
}

static inline T FN(float_floordiv)(T a, T b)
{
    T mod;
    return b ? FN(float_divmod)(a, b, &mod) : a / b;
}

static inline T FN(float_mod)(T a, T b)
{
    T mod;
    if (!b)
        return M(fmod)(a, b);
    FN(float_divmod)(a, b, &mod);
    return mod;
}

/* NumPy's minimum / maximum: a NaN operand wins; a tie gives the first operand */
static inline T FN(float_min)(T a, T b) { return (isnan(a) || a <= b) ? a : b; }
static inline T FN(float_max)(T a, T b) { return (isnan(a) || a >= b) ? a : b; }

int FN(interp_eval)(const interp_mods *mods, const interp_prog *pg, const interp_tile *t,
                    const T *score, const T *dout, T *out_f, unsigned char *out_b, double *dacc,
                    void *stash, void *scratch)
{
    T *fstash = (T *)stash;
    int64_t *istash = (int64_t *)(fstash + mods->n_fstash * t->n);
    const int64_t VL = INTERP_VL, nf = pg->n_fregs, ni = pg->n_iregs;
    /* scratch: float registers, int registers, their pointers, lookup offsets (interp.c) */
    char *s = (char *)scratch;
    T *fbase = (T *)s;
    s += nf * VL * sizeof(T);
    int64_t *ibase = (int64_t *)s;
    s += ni * VL * sizeof(int64_t);
    int64_t *offs = (int64_t *)s;
    s += VL * sizeof(int64_t);
    T **fr = (T **)s;
    s += nf * sizeof(T *);
    int64_t **ir = (int64_t **)s;
    for (int64_t r = 0; r < nf; r++)
        fr[r] = fbase + r * VL;
    for (int64_t r = 0; r < ni; r++)
        ir[r] = ibase + r * VL;

    /* registers that hold one value for the whole tile */
    for (int64_t c = 0; c < pg->n_floats; c++)
        for (int64_t k = 0; k < VL; k++)
            fr[INTERP_F_FIRST_CONST + c][k] = (T)pg->floats[c];
    for (int64_t k = 0; k < VL; k++) {
        ir[INTERP_I_B][k] = t->b;
        ir[INTERP_I_H][k] = t->h;
    }
    for (int64_t c = 0; c < pg->n_iconst; c++)
        for (int64_t k = 0; k < VL; k++)
            ir[INTERP_I_FIRST_CONST + c][k] = pg->iconst[c];

    for (int64_t base = 0; base < t->n; base += VL) {
        const int64_t m = t->n - base < VL ? t->n - base : VL;
        const unsigned char *act = t->active ? t->active + base : NULL;
        if (score)
            fr[INTERP_F_SCORE] = (T *)score + base;
        if (dout)
            fr[INTERP_F_DOUT] = (T *)dout + base;
        {
            int64_t row = base / t->ld, col = base % t->ld;
            int64_t *qi = ir[INTERP_I_Q], *ki = ir[INTERP_I_KV];
            for (int64_t k = 0; k < m; k++) {
                qi[k] = t->r0 + row;
                ki[k] = t->c0 + col;
                if (++col == t->ld) {
                    col = 0;
                    row++;
                }
            }
        }
        for (int64_t n = 0; n < pg->n_instr; n++) {
            const int64_t *in = pg->instr + 5 * n;
            const int64_t op = in[0], d = in[1], a = in[2], b = in[3], c = in[4];

#define F_BIN(expr)                                                                             \
    {                                                                                           \
        const T *x = fr[a], *y = fr[b];                                                         \
        T *z = fr[d];                                                                           \
        for (int64_t k = 0; k < m; k++) {                                                       \
            const T A = x[k], B = y[k];                                                         \
            z[k] = (expr);                                                                      \
        }                                                                                       \
    }                                                                                           \
    break;
#define F_UN(expr)                                                                              \
    {                                                                                           \
        const T *x = fr[a];                                                                     \
        T *z = fr[d];                                                                           \
        for (int64_t k = 0; k < m; k++) {                                                       \
            const T A = x[k];                                                                   \
            z[k] = (expr);                                                                      \
        }                                                                                       \
    }                                                                                           \
    break;
#define F_CMP(expr)                                                                             \
    {                                                                                           \
        const T *x = fr[a], *y = fr[b];                                                         \
        int64_t *z = ir[d];                                                                     \
        for (int64_t k = 0; k < m; k++) {                                                       \
            const T A = x[k], B = y[k];                                                         \
            z[k] = (expr);                                                                      \
        }                                                                                       \
    }                                                                                           \
    break;
#define I_BIN(expr)                                                                             \
    {                                                                                           \
        const int64_t *x = ir[a], *y = ir[b];                                                   \
        int64_t *z = ir[d];                                                                     \
        for (int64_t k = 0; k < m; k++) {                                                       \
            const int64_t A = x[k], B = y[k];                                                   \
            z[k] = (expr);                                                                      \
        }                                                                                       \
    }                                                                                           \
    break;
/* an integer op of type c (interp.h): int64's own loop, the typed rule (mod_ints.h) otherwise */
#define I_TYPED(expr64, exprt)                                                                  \
    {                                                                                           \
        const int64_t *x = ir[a], *y = ir[b];    /* y: unused by unary ops */                   \
        int64_t *z = ir[d];                                                                     \
        const int t = (int)c;                                                                   \
        if (t == MOD_I64)                                                                       \
            for (int64_t k = 0; k < m; k++) {                                                   \
                const int64_t A = x[k], B = y[k];                                               \
                z[k] = (expr64);                                                                \
                (void)B;                                                                        \
            }                                                                                   \
        else                                                                                    \
            for (int64_t k = 0; k < m; k++) {                                                   \
                const int64_t A = x[k], B = y[k];                                               \
                z[k] = (exprt);                                                                 \
                (void)B;                                                                        \
            }                                                                                   \
    }                                                                                           \
    break;
#define I_UN(expr)                                                                              \
    {                                                                                           \
        const int64_t *x = ir[a];                                                               \
        int64_t *z = ir[d];                                                                     \
        for (int64_t k = 0; k < m; k++) {                                                       \
            const int64_t A = x[k];                                                             \
            z[k] = (expr);                                                                      \
        }                                                                                       \
    }                                                                                           \
    break;

            switch ((interp_op)op) {
            case OP_f_add: F_BIN(A + B)
            case OP_f_sub: F_BIN(A - B)
            case OP_f_mul: F_BIN(A * B)
            case OP_f_truediv: F_BIN(A / B)
            case OP_f_floordiv: F_BIN(FN(float_floordiv)(A, B))
            case OP_f_mod: F_BIN(FN(float_mod)(A, B))
            case OP_f_pow: F_BIN(M(pow)(A, B))
            case OP_f_minimum: F_BIN(FN(float_min)(A, B))
            case OP_f_maximum: F_BIN(FN(float_max)(A, B))
            /* an adjoint of 0 contributes 0 even where the local derivative is inf or NaN */
            case OP_f_dmul: F_BIN(A == 0 ? (T)0 : A * B)
            case OP_f_neg: F_UN(-A)
            case OP_f_abs: F_UN(M(fabs)(A))
#define LIBM1(name) case OP_##name: F_UN(M(name)(A))
#define LIBM2(name) case OP_##name: F_BIN(M(name)(A, B))
            INTERP_LIBM1(LIBM1)
            INTERP_LIBM2(LIBM2)
#undef LIBM1
#undef LIBM2
            case OP_f_where: {
                const int64_t *cond = ir[a];
                const T *x = fr[b], *y = fr[c];
                T *z = fr[d];
                for (int64_t k = 0; k < m; k++)
                    z[k] = cond[k] ? x[k] : y[k];
                break;
            }
            case OP_f_from_i: {
                const int64_t *x = ir[a];
                T *z = fr[d];
                if (c == MOD_U64)
                    for (int64_t k = 0; k < m; k++)
                        z[k] = (T)(uint64_t)x[k];
                else
                    for (int64_t k = 0; k < m; k++)
                        z[k] = (T)x[k];
                break;
            }
            case OP_f_lt: F_CMP(A < B)
            case OP_f_le: F_CMP(A <= B)
            case OP_f_gt: F_CMP(A > B)
            case OP_f_ge: F_CMP(A >= B)
            case OP_f_eq: F_CMP(A == B)
            case OP_f_ne: F_CMP(A != B)
            case OP_i_add: I_TYPED(mod_iadd(A, B), mod_tadd(A, B, t))
            case OP_i_sub: I_TYPED(mod_isub(A, B), mod_tsub(A, B, t))
            case OP_i_mul: I_TYPED(mod_imul(A, B), mod_tmul(A, B, t))
            case OP_i_floordiv: I_TYPED(mod_ifloordiv(A, B), mod_tfloordiv(A, B, t))
            case OP_i_mod: I_TYPED(mod_imod(A, B), mod_tmod(A, B, t))
            case OP_i_pow: I_TYPED(mod_ipow(A, B), mod_tpow(A, B, t))
            case OP_i_minimum: I_TYPED(A <= B ? A : B, mod_tmin(A, B, t))
            case OP_i_maximum: I_TYPED(A >= B ? A : B, mod_tmax(A, B, t))
            case OP_i_and: I_BIN(A & B)       /* of values held as mod_ints.h says: no wrap */
            case OP_i_or: I_BIN(A | B)
            case OP_i_xor: I_BIN(A ^ B)
            case OP_i_neg: I_TYPED(mod_ineg(A), mod_tneg(A, t))
            case OP_i_abs: I_TYPED(A < 0 ? mod_ineg(A) : A, mod_tabs(A, t))
            case OP_i_not: I_TYPED(~A, mod_tnot(A, t))
            case OP_i_cast: I_TYPED(A, mod_wrap(A, t))
            case OP_b_not: I_UN(!A)
            case OP_i_where: {
                const int64_t *cond = ir[a], *x = ir[b], *y = ir[c];
                int64_t *z = ir[d];
                for (int64_t k = 0; k < m; k++)
                    z[k] = cond[k] ? x[k] : y[k];
                break;
            }
            case OP_i_lt: I_TYPED(A < B, mod_tlt(A, B, t))
            case OP_i_le: I_TYPED(A <= B, mod_tle(A, B, t))
            case OP_i_gt: I_TYPED(A > B, mod_tlt(B, A, t))
            case OP_i_ge: I_TYPED(A >= B, mod_tle(B, A, t))
            case OP_i_eq: I_BIN(A == B)
            case OP_i_ne: I_BIN(A != B)
            case OP_load_f:
            case OP_load_i: {
                const interp_array *arr = &pg->arrays[a];
                if (lookup_offsets(mods, pg, a, pg->aux + b, c, ir, m, act, offs))
                    return -1;
                if (op == OP_load_f) {
                    const T *src = (const T *)arr->data;
                    T *z = fr[d];
                    for (int64_t k = 0; k < m; k++)
                        z[k] = offs[k] < 0 ? (T)0 : src[offs[k]];
                } else if (arr->kind == ARR_BOOL) {
                    const unsigned char *src = (const unsigned char *)arr->data;
                    int64_t *z = ir[d];
                    for (int64_t k = 0; k < m; k++)
                        z[k] = offs[k] < 0 ? 0 : src[offs[k]] != 0;
                } else {
                    const int64_t *src = (const int64_t *)arr->data;
                    int64_t *z = ir[d];
                    for (int64_t k = 0; k < m; k++)
                        z[k] = offs[k] < 0 ? 0 : src[offs[k]];
                }
                break;
            }
            case OP_scatter: {
                const interp_array *arr = &pg->arrays[a];
                if (lookup_offsets(mods, pg, a, pg->aux + b, c, ir, m, act, offs))
                    return -1;
                if (!dacc)
                    break;
                double *acc = dacc + arr->grad_offset;
                const T *x = fr[d];
                for (int64_t k = 0; k < m; k++)
                    if ((!act || act[k]) && offs[k] >= 0)
                        acc[offs[k]] += (double)x[k];
                break;
            }
            case OP_stash_f:
                memcpy(fstash + a * t->n + base, fr[d], sizeof(T) * m);
                break;
            case OP_stash_i:
                memcpy(istash + a * t->n + base, ir[d], sizeof(int64_t) * m);
                break;
            case OP_unstash_f:
                memcpy(fr[d], fstash + a * t->n + base, sizeof(T) * m);
                break;
            case OP_unstash_i:
                memcpy(ir[d], istash + a * t->n + base, sizeof(int64_t) * m);
                break;
            case OP_COUNT:
                break;
            }
#undef F_BIN
#undef F_UN
#undef F_CMP
#undef I_BIN
#undef I_TYPED
#undef I_UN
        }
        if (out_f) {
            const T *x = fr[pg->out];
            if (x != out_f + base)
                memmove(out_f + base, x, sizeof(T) * m);
        }
        if (out_b) {
            const int64_t *x = ir[pg->out];
            for (int64_t k = 0; k < m; k++)
                out_b[base + k] = x[k] != 0;
        }
    }
    return 0;
}

#undef FN
#undef CAT
#undef CAT_
