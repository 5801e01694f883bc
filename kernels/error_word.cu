// kernels/error_word.cu — taking the device-side error word (kvt_error_take):
// see kernels/abi.h for the contract.
#include "common.cuh"

// One lane: the exchanges are a handful. Each field is conserved on its own:
// a report the take overlaps (its three atomics in `report`, common.cuh) may
// land partly in *out and partly in *word, never nowhere.
extern "C" __global__ void __launch_bounds__(KVT_WARP) kvt_error_take(const kvt_error_take_params p) {
    using namespace kvt;
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    kvt_error_word* word = reinterpret_cast<kvt_error_word*>(p.word);
    kvt_error_word* out = reinterpret_cast<kvt_error_word*>(p.out);
    for (uint32_t k = 0; k < KVT_ERR_KINDS; ++k) {
        unsigned long long* f = reinterpret_cast<unsigned long long*>(&word->first[k]);
        st(&out->first[k], (uint64_t)exchange(f, (unsigned long long)KVT_ERR_FIRST_NONE));
    }
    st(&out->count, exchange(&word->count, 0u));
    st(&out->flags, exchange(&word->flags, 0u));
}
