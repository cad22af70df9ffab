/* The smallest native kernel: proves the build and the ctypes call path (tests/kernels). */
#include <stdint.h>

int64_t loraplex_native_abi(void) { return 1; }

void loraplex_add_f32(const float *a, const float *b, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}
