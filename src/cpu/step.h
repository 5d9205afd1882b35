// One optimizer step over a list of tensors, split across the pool by element count.
#pragma once
#include <vector>
#include "adam_types.h"

namespace mfa {

// Updates every span with `fn` (an entry of an IsaTable), on up to `threads` threads. Work is
// divided by elements, not tensors, so 1,000 small tensors balance as well as one large one.
// `scalars`: the rule's scalar struct, read by every thread.
void run_step(const std::vector<Span>& spans, SpanFn fn, const void* scalars, int threads);

}  // namespace mfa
