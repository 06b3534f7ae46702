// The version of the library's function signatures (abi.h).
#include "abi.h"

extern "C" int capsctl_kernels_abi() { return CAPSCTL_KERNELS_ABI; }
