//! `train-tokenizer OUT_DIR`: trains the project's small byte-level BPE tokenizer on a corpus this
//! program generates (English-like words, code, numbers and CJK, from a fixed seed), with ChatML's
//! special tokens, and writes `tokenizer.json` and a `tokenizer_config.json` carrying a ChatML chat
//! template. Deterministic: the same program writes the same files, which tests and the simulator
//! use so that engines and the indexer tokenize alike without downloading a model.

use std::path::PathBuf;
use std::process::ExitCode;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder};

const VOCAB: usize = 4096;
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

const CHAT_TEMPLATE: &str = "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}{% for message in messages %}{% if message.role != 'system' %}<|im_start|>{{ message.role }}\n{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A fixed-seed xorshift, so the corpus is the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a>(&mut self, xs: &'a [&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

fn corpus() -> Vec<String> {
    let words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "was",
        "with",
        "be",
        "by",
        "on",
        "not",
        "he",
        "this",
        "are",
        "or",
        "his",
        "from",
        "at",
        "which",
        "but",
        "have",
        "an",
        "had",
        "they",
        "you",
        "were",
        "their",
        "one",
        "all",
        "we",
        "can",
        "her",
        "has",
        "there",
        "been",
        "if",
        "more",
        "when",
        "will",
        "would",
        "who",
        "so",
        "model",
        "router",
        "engine",
        "cache",
        "prefix",
        "token",
        "request",
        "latency",
        "throughput",
        "bucket",
        "prefill",
        "decode",
        "session",
        "system",
        "user",
        "assistant",
        "question",
        "answer",
        "please",
        "explain",
        "summarize",
        "document",
        "function",
        "return",
        "value",
        "error",
        "config",
        "server",
        "client",
        "data",
    ];
    let code = ["fn", "let", "mut", "impl", "struct", "def", "class", "import", "{", "}", "(", ")", ";", "=>", "::"];
    let cjk = ["漢字", "日本語", "中文", "模型", "缓存", "请求", "東京", "北京", "한국어", "데이터"];
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    (0..20_000u32)
        .map(|i| {
            let n = 8 + (rng.next() % 40) as usize;
            let mut line = String::new();
            for _ in 0..n {
                let word = match rng.next() % 10 {
                    0 => rng.pick(&code).to_string(),
                    1 => rng.pick(&cjk).to_string(),
                    2 => (rng.next() % 10_000).to_string(),
                    _ => rng.pick(&words).to_string(),
                };
                line.push_str(&word);
                line.push(if rng.next().is_multiple_of(12) { '.' } else { ' ' });
            }
            if i.is_multiple_of(7) {
                line.push('\n');
            }
            line
        })
        .collect()
}

fn main() -> ExitCode {
    let Some(out) = std::env::args().nth(1).map(PathBuf::from) else {
        eprintln!("usage: train-tokenizer OUT_DIR");
        return ExitCode::from(2);
    };
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(VOCAB)
        .min_frequency(2)
        .special_tokens(SPECIALS.iter().map(|s| AddedToken::from(s.to_string(), true)).collect())
        .build();
    let built = TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, PostProcessorWrapper, ByteLevel>::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_decoder(Some(ByteLevel::default()))
        .build();
    let mut tokenizer = match built {
        Ok(t) => t,
        Err(e) => {
            eprintln!("train-tokenizer: {e}");
            return ExitCode::from(1);
        }
    };
    let corpus = corpus();
    if let Err(e) = tokenizer.train(&mut trainer, corpus.iter()) {
        eprintln!("train-tokenizer: training failed: {e}");
        return ExitCode::from(1);
    }
    let config = serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    });
    let written = std::fs::create_dir_all(&out)
        .map_err(|e| e.to_string())
        .and_then(|()| tokenizer.save(out.join("tokenizer.json"), true).map_err(|e| e.to_string()))
        .and_then(|_| {
            let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
            std::fs::write(out.join("tokenizer_config.json"), text + "\n").map_err(|e| e.to_string())
        });
    match written {
        Ok(()) => {
            eprintln!("train-tokenizer: wrote {}/tokenizer.json and tokenizer_config.json", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("train-tokenizer: {e}");
            ExitCode::from(1)
        }
    }
}
