// A loaded model as the HTTP layer serves it: tokenizer, chat template, and the scheduler that
// owns the engine thread. Built by the CLI (from a checkpoint or the scripted test engine).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "runtime/scheduler.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace gemma4::server {

struct ServingModel {
  ServingModel(text::Tokenizer tokenizer_, text::ChatTemplate chat_template_)
      : tokenizer(std::move(tokenizer_)), chat_template(chat_template_) {}

  std::string id;           // what /v1/models and responses call the model
  std::string description;  // one line for logs and the UI ("synthetic tiny model", ...)
  bool synthetic = false;   // random weights: output is noise, said so in /v1/models and the UI
  text::Tokenizer tokenizer;
  text::ChatTemplate chat_template;
  std::vector<int32_t> stop_tokens;  // ids that end a generation (eos_token_id)
  int32_t bos_token = -1;            // prepended to /v1/completions prompts that lack it

  // Declaration order is destruction order reversed: the scheduler (engine thread) stops first,
  // then the engine, then whatever the engine reads (weights, mapped files).
  std::shared_ptr<void> engine_resources;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<runtime::Scheduler> scheduler;
};

}  // namespace gemma4::server
