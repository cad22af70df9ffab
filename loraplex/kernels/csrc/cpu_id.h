/* Which CPU this is, where a kernel's tuning was measured on one family and not the others. */
#ifndef LORAPLEX_CPU_ID_H
#define LORAPLEX_CPU_ID_H

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* AMD's CPU family (0x19: Zen 3 and Zen 4, 0x1A: Zen 5), 0 on any other vendor or
   architecture; asked once, the same for every caller */
static inline int amd_family(void) {
    static int known = -1; /* -1 until asked */
    int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (v < 0) {
        v = 0;
#if defined(__x86_64__) || defined(__i386__)
        unsigned a, b, c, d;
        if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u /* "Auth" of AuthenticAMD */
            && __get_cpuid(1, &a, &b, &c, &d)) {
            const unsigned base = (a >> 8) & 0xF, ext = (a >> 20) & 0xFF;
            v = (int)(base == 0xF ? base + ext : base);
        }
#endif
        __atomic_store_n(&known, v, __ATOMIC_RELAXED);
    }
    return v;
}

#endif
