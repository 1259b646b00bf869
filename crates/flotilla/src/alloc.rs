//! The process allocator (mimalloc) and the one moment it is told to hand
//! memory back at once: loading a model.

/// mimalloc's `mi_option_purge_delay` (its place in the option enum in
/// both v2 and v3): how long freed memory stays committed before it is
/// purged, lazily, on later allocator calls (in milliseconds; 1,000 in this
/// build; -1: never).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Runs `f` (a model load) with freed memory purged as it is freed, then
/// collects what is left. A load frees as much as it keeps (each tensor's
/// intermediate layouts, and the converted copy of the weights once the
/// layout cache is written and mapped in its place); left to the default
/// delay, mimalloc kept it committed while the cache's pages came in: a
/// 1.5B model's first load peaked at 2.77 GB instead of 1.93.
pub(crate) fn loading<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: mimalloc's option and collect calls take plain values and
    // are safe from any thread at any time.
    let before = unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) };
    // Only where the option reads as a delay would (a guard against the
    // enum moving in another mimalloc).
    let known = (-1..=600_000).contains(&before);
    if known {
        // SAFETY: as above.
        unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, 0) };
    }
    let out = f();
    // SAFETY: as above.
    unsafe {
        if known {
            libmimalloc_sys::mi_option_set(PURGE_DELAY, before);
        }
        libmimalloc_sys::mi_collect(true);
    }
    out
}
