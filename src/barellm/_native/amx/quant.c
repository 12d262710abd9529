/* The amx tier's matmuls on the tile instructions (amx/matmul.h holds the kernels; their plain C parts are
 * compiled for AVX-512 here, which every CPU with AMX has). */
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define AMX_NAME(t) bl_mm_##t##_amx
#include "amx/matmul.h"
