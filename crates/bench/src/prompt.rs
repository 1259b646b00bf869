//! Deterministic prompts: request `i` of seed `s` is always the same text.
//!
//! Prompt length is uniform in words over `[min, max]`; words are drawn
//! uniformly from a fixed list of common English words, so every server sees
//! the same prompts and tokenises them in its own way (the report counts
//! prompt tokens from the server's usage, not from words).

use flotilla_exec::rng::SplitMix64;

/// The fixed vocabulary. Changing it changes every prompt: keep it fixed so
/// reports from different builds stay comparable.
const WORDS: [&str; 128] = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "his", "they",
    "be", "at", "one", "have", "this", "from", "by", "hot", "word", "but", "what", "some", "we",
    "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said",
    "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many",
    "then", "them", "write", "would", "like", "so", "these", "her", "long", "make", "thing", "see",
    "him", "two", "has", "look", "more", "day", "could", "go", "come", "did", "number", "sound",
    "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who", "may",
    "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place",
    "made", "live", "where", "after", "back", "little", "only", "round", "man", "year", "came",
    "show", "every", "good", "me", "give", "our", "under", "name", "very", "through", "just",
    "form", "sentence", "great", "think", "say", "help", "low",
];

/// Whether request `index` of seed `seed` is dropped on purpose, and after
/// how many generated chunks (1..=8): a seeded `fraction` of requests.
pub fn cancel_after(seed: u64, index: u64, fraction: f64) -> Option<u64> {
    if fraction <= 0.0 {
        return None;
    }
    let mut r =
        SplitMix64(seed ^ index.wrapping_mul(0xA24B_AED4_963E_E407) ^ 0xC0FF_EE00_D15C_A4D5);
    let u = (r.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (u < fraction).then(|| 1 + below(&mut r, 8))
}

/// The max_tokens of request `index`: uniform over `min..=max`, seeded.
pub fn max_tokens_for(seed: u64, index: u64, min: u32, max: u32) -> u32 {
    if min >= max {
        return max;
    }
    let mut r = SplitMix64(seed ^ index.wrapping_mul(0x9FB2_1C65_1E98_DF25) ^ 0x005E_ED0F_0A1E);
    min + below(&mut r, u64::from(max - min) + 1) as u32
}

/// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-32
/// for the small `n` used here).
fn below(r: &mut SplitMix64, n: u64) -> u64 {
    debug_assert!(n > 0);
    ((u128::from(r.next_u64()) * u128::from(n)) >> 64) as u64
}

/// The prompt of request `index` under `seed`, `min..=max` words long.
pub fn prompt(seed: u64, index: u64, words_min: usize, words_max: usize) -> String {
    assert!(
        0 < words_min && words_min <= words_max,
        "prompt length range {words_min}..={words_max}"
    );
    // Mix the index in through one SplitMix step so neighbouring seeds and
    // indices give unrelated streams.
    let mut rng =
        SplitMix64(SplitMix64(seed).next_u64() ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03));
    let span = (words_max - words_min) as u64 + 1;
    let len = words_min + below(&mut rng, span) as usize;
    let mut out = String::with_capacity(len * 6);
    for i in 0..len {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[below(&mut rng, WORDS.len() as u64) as usize]);
    }
    out
}

/// The report's statement of the prompt distribution.
pub fn describe(words_min: usize, words_max: usize) -> String {
    format!(
        "uniform {words_min}..={words_max} words per prompt, words drawn uniformly from a fixed \
         {}-word English list (deterministic in seed and request index)",
        WORDS.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_index_give_the_same_prompt() {
        assert_eq!(prompt(3, 7, 16, 256), prompt(3, 7, 16, 256));
        assert_ne!(prompt(3, 7, 16, 256), prompt(3, 8, 16, 256));
        assert_ne!(prompt(3, 7, 16, 256), prompt(4, 7, 16, 256));
    }

    #[test]
    fn lengths_stay_in_range_and_cover_it() {
        let (lo, hi) = (4, 9);
        let mut seen = [false; 10];
        for i in 0..500 {
            let n = prompt(0, i, lo, hi).split(' ').count();
            assert!((lo..=hi).contains(&n), "{n} words");
            seen[n] = true;
        }
        assert!(seen[lo..=hi].iter().all(|&s| s));
        assert_eq!(prompt(1, 1, 5, 5).split(' ').count(), 5);
    }

    #[test]
    fn cancel_after_drops_about_the_fraction() {
        let n = (0..10_000)
            .filter(|&i| super::cancel_after(3, i, 0.2).is_some())
            .count();
        assert!((1_800..2_200).contains(&n), "{n}");
        assert_eq!(super::cancel_after(3, 5, 0.0), None);
        assert!(
            (0..100).all(|i| super::cancel_after(3, i, 1.0).is_some_and(|k| (1..=8).contains(&k)))
        );
        assert_eq!(
            super::cancel_after(9, 42, 0.5),
            super::cancel_after(9, 42, 0.5)
        );
    }

    #[test]
    fn max_tokens_for_covers_the_range_deterministically() {
        let v: Vec<u32> = (0..2000)
            .map(|i| super::max_tokens_for(4, i, 8, 128))
            .collect();
        assert!(v.iter().all(|&m| (8..=128).contains(&m)));
        assert!(v.contains(&8) && v.contains(&128));
        assert_eq!(super::max_tokens_for(4, 7, 8, 128), v[7]);
        assert_eq!(super::max_tokens_for(4, 7, 64, 64), 64);
    }
}
