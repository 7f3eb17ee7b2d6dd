// Gemma tokenizer: merge-rank BPE over Unicode characters with byte fallback, matching the
// Hugging Face `tokenizers` library on Gemma's tokenizer.json (spec gemma4-chat-format.md §1).
//
// Pipeline (encode):
//   1. split out added tokens (leftmost-longest match on the raw bytes);
//   2. normalize each remaining segment: U+0020 -> U+2581 '▁';
//   3. one symbol per code point (its vocab id, else one <0xNN> token per UTF-8 byte);
//   4. merge the adjacent pair with the lowest merge rank (leftmost on ties) until none is left.
// Input that is not valid UTF-8 is accepted: every byte that does not start a well-formed UTF-8
// sequence becomes its <0xNN> byte token (HF's Python API cannot take such input at all).
//
// A loaded Tokenizer is immutable; encode/decode may run on many threads at once (BPE scratch
// space and the cache of recently encoded chunks are per thread).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"

namespace gemma4::text {

// Token kinds as GGUF's `tokenizer.ggml.token_type` numbers them (SentencePiece's enum).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

class Tokenizer {
 public:
  // Loads a Hugging Face tokenizer.json. Supports the Gemma shape (normalizer Replace ' '->'▁'
  // or none, pre-tokenizer Split ' ' or none, BPE model, decoder Replace/ByteFallback/Fuse);
  // anything else is refused with kUnsupported rather than tokenized differently.
  static Expected<Tokenizer> from_json_file(const std::filesystem::path& path);
  static Expected<Tokenizer> from_json_text(std::string_view json_text);

  // Builds a tokenizer from GGUF-style metadata:
  //   tokens      `tokenizer.ggml.tokens`: the piece of every id, index = id;
  //   token_types `tokenizer.ggml.token_type` (TokenType values), same length as tokens, or
  //               empty for "all normal";
  //   merges      `tokenizer.ggml.merges`: "left right" strings, rank = index. Each is split at
  //               the first U+0020 after its first byte.
  // Added tokens (matched in raw text before BPE): kControl and kUnknown tokens are special,
  // kUserDefined tokens are non-special (always matched, as HF does for special=false).
  // Byte fallback is on when all 256 <0xNN> pieces exist; unknown characters otherwise map to
  // the first kUnknown token (or "<unk>"). Normalization is Gemma's (space -> '▁').
  // (`tokenizer.ggml.scores` is not needed: merge ranks, not scores, drive this BPE.)
  static Expected<Tokenizer> from_vocab(std::vector<std::string> tokens,
                                        std::span<const int32_t> token_types,
                                        std::span<const std::string> merges);

  // Builds a SentencePiece BPE tokenizer from a vocabulary with scores and no merges (GGUF
  // `tokenizer.ggml.model` = "llama", e.g. Gemma 3): BPE repeatedly merges the adjacent pair
  // whose concatenation is a normal or user-defined piece with the highest score, leftmost on
  // ties (SentencePiece's bpe_model.cc). That is merge-rank BPE over the merges (left, right) of
  // every such piece split into two such pieces, ranked by the piece's score (equal scores, equal
  // rank), which is how it is built. tokens/token_types as in from_vocab; scores: one per token.
  static Expected<Tokenizer> from_scored_vocab(std::vector<std::string> tokens,
                                               std::span<const int32_t> token_types,
                                               std::span<const float> scores);

  // Text -> ids. With parse_special=false, the text of special tokens (e.g. "<|turn>") is
  // tokenized as ordinary characters, so user text never yields control ids; non-special added
  // tokens are still matched (HF's `encode_special_tokens=True`). No BOS is added.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = false) const;

  // encode(text, parse_special=true), except that special tokens overlapping the `untrusted` byte
  // ranges [begin, end) (sorted, disjoint: RenderedPrompt::untrusted) stay plain text. Text
  // without special-token look-alikes in those ranges gets exactly the ids of encode(text, true).
  std::vector<int32_t> encode_protected(std::string_view text,
                                        std::span<const std::pair<size_t, size_t>> untrusted) const;

  // Ids -> text, as HF `decode` does: '▁' -> ' ', runs of <0xNN> tokens joined into bytes (a run
  // that is not valid UTF-8 becomes one U+FFFD per byte), ids outside the vocabulary dropped.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int32_t token_to_id(std::string_view token) const;  // -1 if the piece does not exist
  std::string_view id_to_token(int32_t id) const;     // "" for an id outside the vocabulary
  int32_t vocab_size() const { return static_cast<int32_t>(token_offsets_.size()) - 1; }
  bool is_special(int32_t id) const { return has_id(id) && special_[id]; }

  // Decoding pieces one id at a time (for IncrementalDetokenizer): whether `id` exists, the
  // byte a byte-fallback token stands for (-1 if it is not one), and the text of any other id.
  bool has_id(int32_t id) const { return id >= 0 && id < vocab_size() && exists_[id]; }
  int32_t byte_value(int32_t id) const { return has_id(id) ? byte_values_[id] : -1; }
  std::string_view decoded_piece(int32_t id) const;

 private:
  struct Merge {        // one entry of the pair -> merge table
    uint64_t pair_key;  // kEmptyPair for a free slot
    uint32_t rank;
    int32_t merged_id;
  };
  struct AddedToken {
    std::string text;
    int32_t id;
    bool special;
  };
  struct TrieNode {
    int32_t token_index = -1;  // index into added_tokens_ of the token ending here, or -1
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node index), sorted by byte
  };
  // What both loaders produce; build() turns it into the lookup tables.
  struct LoadedVocab {
    std::vector<std::string> pieces;  // index = id; holes are "" with exists = 0
    std::vector<uint8_t> exists;
    std::vector<std::pair<std::string, std::string>> merges;
    std::vector<uint32_t> merge_ranks;  // rank of merges[i]; empty: rank = index
    std::vector<AddedToken> added_tokens;
    bool byte_fallback = false;
    bool fuse_unk = false;
    bool space_to_underline = true;
    std::string unk_token;  // "" for none
  };

  static Expected<Tokenizer> build(LoadedVocab vocab);
  // The part of from_vocab / from_scored_vocab that reads tokens and token types.
  static Expected<LoadedVocab> typed_vocab(std::vector<std::string> tokens,
                                           std::span<const int32_t> token_types);

  std::vector<int32_t> encode_with_added_tokens(
      std::string_view text, bool parse_special,
      std::span<const std::pair<size_t, size_t>> untrusted) const;

  const Merge* find_merge(int32_t left, int32_t right) const;
  int32_t char_id(uint32_t code_point) const;
  size_t next_char(std::string_view segment, size_t i, uint32_t& code_point) const;
  void encode_segment(std::string_view segment, std::vector<int32_t>& out) const;
  void encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const;
  void merge_and_emit(std::vector<int32_t>& out) const;

  // Token pieces, as in the vocabulary, packed: piece i = text_[offsets_[i], offsets_[i+1]).
  std::string token_text_;
  std::vector<uint32_t> token_offsets_;
  // Pieces with '▁' replaced by ' ' (what decode emits for a non-byte token).
  std::string decoded_text_;
  std::vector<uint32_t> decoded_offsets_;
  std::vector<int16_t> byte_values_;
  std::vector<uint8_t> special_;
  std::vector<uint8_t> exists_;  // ids can have holes when added tokens lie beyond the vocab

  std::vector<int32_t> token_index_;   // open-addressing piece -> id table (-1 = free)
  std::vector<Merge> merges_;          // open-addressing (left, right) -> merge table
  std::vector<int32_t> bmp_char_ids_;  // code point < 0x10000 -> id of that one-char piece
  std::unordered_map<uint32_t, int32_t> astral_char_ids_;
  std::array<int32_t, 256> byte_token_ids_{};
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool space_to_underline_ = true;  // the normalizer: U+0020 -> U+2581
  int32_t unk_id_ = -1;
  // Chunk boundaries no merge can cross, so BPE runs on each chunk alone (same ids, small heaps,
  // cacheable words): between '\n' and another character, and before a '▁' that follows another
  // character -- except next to the few characters some merge result joins there (found at load:
  // for Gemma, only '>' before '▁', from the piece ">▁</").
  bool split_at_newlines_ = false;
  bool split_before_underline_ = false;
  std::vector<uint32_t> newline_joiners_;    // sorted code points
  std::vector<uint32_t> underline_joiners_;  // sorted code points
  uint64_t cache_id_ = 0;  // identifies this vocabulary in the per-thread chunk cache

  std::vector<AddedToken> added_tokens_;
  std::vector<TrieNode> added_trie_;          // node 0 is the root
  std::array<bool, 256> added_first_byte_{};  // bytes that can start an added token
};

}  // namespace gemma4::text
