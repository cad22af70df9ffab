/* The machine's vector register, for kernels written in GCC/clang vector types: VW floats (16
 * with AVX-512, else 8, AVX2's 256 bits). A 64-byte vector on an AVX2 machine is lowered to a
 * pair of registers: loops that keep many accumulators then spill, and gcc's register
 * allocation of prefill_attention.c's tiles took minutes. Included by attention.h and lora.c
 * (loraplex/kernels/native.py hashes every header into each build's cache key). */
#ifndef LORAPLEX_VECTOR_WIDTH_H
#define LORAPLEX_VECTOR_WIDTH_H

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif

#endif
