// The records pipeline's phases in C++ alone (no torch, no Python), in CPU
// nanoseconds per example, for work on the parser and RecordInput without
// the rest of the pipeline in the way. The files are the ones
// benchmarks/records_vs_tf_data.py writes (run it once first):
//
//   records_bench [--phase crc|read|input|parse]... [--layout packed|columns]
//                 [--batch N] [--seconds S] [--held BATCHES] [--reps N]
//                 [--keep-outputs BATCHES] [--buffer-size RECORDS]
//                 [--verbose] [--json PATH] [DIR]
//
//   crc     CRC32C over 64 B..64 KiB buffers in the cache, the dispatched
//           path against the portable tables (not in the default phases)
//   read    RecordReader::next over every file on one thread (reads,
//           framing, CRCs; no copy), thread CPU per record
//   input   RecordInput with its defaults but the batch size, drained by
//           this thread: examples/s and CPU per example of its readers,
//           its mixer and the consumer
//   parse   BatchParser (scan, count, fill) on one thread over --held
//           batches (50) held in memory, outputs allocated per batch as
//           parse_example does (--keep-outputs K: the last K batches' kept
//           alive, as a consumer holding them would)
//
// Every figure is the median of 5 runs (--verbose: each run's on stderr;
// --reps N: exactly N passes, for callgrind).
#include <dirent.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "records/crc32c.h"
#include "records/example.h"
#include "records/record_input.h"
#include "records/record_io.h"

namespace {

using namespace torch_stage::records;

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) +
      1e-9 * static_cast<double>(ts.tv_nsec);
}

double wall_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) +
      1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CPU seconds of this process's threads, summed by thread-name prefix.
std::map<std::string, double> threads_cpu() {
  std::map<std::string, double> out;
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) {
    return out;
  }
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') {
      continue;
    }
    std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/stat");
    std::string stat((std::istreambuf_iterator<char>(f)), {});
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) {
      continue;
    }
    std::string name = stat.substr(open + 1, close - open - 1);
    name = name.rfind("tsrec:read", 0) == 0 ? "read"
        : name.rfind("tsrec:mix", 0) == 0   ? "shuffle"
                                            : "consumer";
    // Fields after ") ": state is field 3; utime, stime are 14 and 15.
    std::vector<std::string> fields;
    size_t at = close + 2;
    while (at < stat.size()) {
      const size_t sp = stat.find(' ', at);
      fields.push_back(stat.substr(at, sp - at));
      if (sp == std::string::npos) {
        break;
      }
      at = sp + 1;
    }
    if (fields.size() > 12) {
      out[name] += (std::stod(fields[11]) + std::stod(fields[12])) / tick;
    }
  }
  closedir(dir);
  return out;
}

std::vector<FeatureSpec> specs_for(const std::string& layout) {
  std::vector<FeatureSpec> specs;
  auto fixed = [&](const std::string& key, int64_t n) {
    FeatureSpec s;
    s.key = key;
    s.fixed_count = n;
    specs.push_back(s);
  };
  fixed("label", 1);
  if (layout == "packed") {
    fixed("dense", 13);
    fixed("cat", 20);
  } else {
    for (int k = 1; k <= 13; ++k) {
      fixed("I" + std::to_string(k), 1);
    }
    for (int k = 1; k <= 20; ++k) {
      fixed("C" + std::to_string(k), 1);
    }
  }
  for (int k = 21; k <= 26; ++k) {
    FeatureSpec s;
    s.key = "C" + std::to_string(k);
    s.var_len = true;
    specs.push_back(s);
  }
  return specs;
}

struct Batch {
  std::vector<uint8_t> data;
  std::vector<int64_t> offsets;
};

// parse_example's work without tensors: outputs malloc'ed per batch, the
// last `keep` batches' kept alive (as a consumer holding them would).
std::vector<std::vector<std::unique_ptr<int64_t[]>>> kept_outputs;
size_t keep_outputs = 0;

size_t parse_batch(const Batch& b, const std::vector<FeatureSpec>& specs) {
  const size_t n = b.offsets.size() - 1;
  std::vector<RecordRef> refs(n);
  for (size_t i = 0; i < n; ++i) {
    refs[i] = RecordRef{
        b.data.data() + b.offsets[i],
        static_cast<size_t>(b.offsets[i + 1] - b.offsets[i]),
        b.data.data() + b.data.size()};
  }
  BatchParser parser(specs, std::move(refs));
  std::vector<FeatureOutput> outs(specs.size());
  std::vector<std::unique_ptr<int64_t[]>> keep;
  for (size_t s = 0; s < specs.size(); ++s) {
    if (!specs[s].var_len) {
      keep.emplace_back(new int64_t[n * specs[s].fixed_count]);
      outs[s].values = keep.back().get();
    }
  }
  parser.scan(0, n, outs);
  parser.check();
  parser.count();
  size_t values = 0;
  for (size_t s = 0; s < specs.size(); ++s) {
    if (specs[s].var_len) {
      const auto v = static_cast<size_t>(parser.var_values(s));
      values += v;
      keep.emplace_back(new int64_t[v + 1]);
      outs[s].values = keep.back().get();
      keep.emplace_back(new int64_t[n + 1]);
      outs[s].offsets = keep.back().get();
    }
  }
  parser.fill(0, n, outs);
  parser.check();
  if (keep_outputs > 0) {
    kept_outputs.push_back(std::move(keep));
    if (kept_outputs.size() > keep_outputs) {
      kept_outputs.erase(kept_outputs.begin());
    }
  }
  return values;
}

} // namespace

int main(int argc, char** argv) {
  std::string layout = "packed";
  std::string dir;
  int64_t batch = 1024;
  double seconds = 2.0;
  size_t held_batches = 50;
  int64_t reps = 0; // parse: exactly this many passes (0: for --seconds)
  int64_t buffer_size = 0; // input: RecordInput's buffer_size (0: default)
  bool verbose = false; // parse: every run's figure on stderr
  std::string json_path; // also write the figures as JSON here
  std::vector<std::string> phases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--layout" && i + 1 < argc) {
      layout = argv[++i];
    } else if (a == "--batch" && i + 1 < argc) {
      batch = std::atoll(argv[++i]);
    } else if (a == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--keep-outputs" && i + 1 < argc) {
      keep_outputs = static_cast<size_t>(std::atoll(argv[++i]));
    } else if (a == "--buffer-size" && i + 1 < argc) {
      buffer_size = std::atoll(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--verbose") {
      verbose = true;
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoll(argv[++i]);
    } else if (a == "--held" && i + 1 < argc) {
      held_batches = static_cast<size_t>(std::atoll(argv[++i]));
    } else if (a == "--phase" && i + 1 < argc) {
      phases.push_back(argv[++i]);
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    } else {
      dir = a;
    }
  }
  if (layout != "packed" && layout != "columns") {
    std::fprintf(
        stderr, "--layout: packed or columns, got %s\n", layout.c_str());
    return 2;
  }
  if (dir.empty()) {
    dir = "build/bench_data/records_vs_tf_data/" + layout;
  }
  if (phases.empty()) {
    phases = {"read", "input", "parse"};
  }
  auto want = [&](const char* p) {
    return std::find(phases.begin(), phases.end(), p) != phases.end();
  };
  std::vector<std::string> files;
  try {
    files = match_files({dir + "/*.tfrecord"});
  } catch (const RecordError& e) {
    std::fprintf(
        stderr,
        "%s\n(write the files first: python benchmarks/records_vs_tf_data.py "
        "--layout %s)\n",
        e.what(),
        layout.c_str());
    return 2;
  }
  const auto specs = specs_for(layout);
  // "key": value pairs of the JSON report, in order.
  std::vector<std::pair<std::string, std::string>> json;
  auto number = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.1f", v);
    return std::string(buf);
  };
  json.emplace_back("\"benchmark\"", "\"records_bench\"");
  json.emplace_back("\"layout\"", "\"" + layout + "\"");
  json.emplace_back("\"batch_size\"", std::to_string(batch));
  std::printf(
      "%s rows, %zu files in %s, batch %lld\n",
      layout.c_str(),
      files.size(),
      dir.c_str(),
      static_cast<long long>(batch));

  if (want("crc")) {
    // CRC32C alone over buffers in the cache: the dispatched path (three
    // lanes with SSE4.2 and PCLMUL) against the portable tables.
    for (const size_t n : {64, 330, 720, 4096, 65536}) {
      std::vector<uint8_t> buf(n);
      for (size_t k = 0; k < n; ++k) {
        buf[k] = static_cast<uint8_t>(k * 131 + 7);
      }
      const size_t passes = (size_t{1} << 27) / n;
      auto time = [&](uint32_t (*fn)(uint32_t, const void*, size_t)) {
        std::vector<double> ns;
        uint32_t c = 0;
        for (int run = 0; run < 5; ++run) {
          const double t0 = thread_cpu_s();
          for (size_t r = 0; r < passes; ++r) {
            c = fn(c, buf.data(), n); // each waits for the last: latency
          }
          ns.push_back((thread_cpu_s() - t0) * 1e9 / passes);
        }
        if (c == 1) { // keeps the loop; never true in practice
          std::printf(" ");
        }
        return median(ns);
      };
      const double fast = time(crc32c_extend);
      const double tables = time(crc32c_extend_portable);
      std::printf(
          "crc     %6zu bytes: %7.1f ns (%5.1f GB/s); tables %7.1f ns "
          "(%4.1f GB/s)\n",
          n,
          fast,
          n / fast,
          tables,
          n / tables);
      json.emplace_back(
          "\"crc_ns_" + std::to_string(n) + "_bytes\"", number(fast));
      json.emplace_back(
          "\"crc_tables_ns_" + std::to_string(n) + "_bytes\"", number(tables));
    }
  }

  if (want("read")) {
    std::vector<double> ns;
    for (int run = 0; run < 5; ++run) {
      const double t0 = thread_cpu_s();
      int64_t records = 0;
      for (const auto& f : files) {
        RecordReader reader(f, Compression::kNone);
        RecordSpan rec;
        while (reader.next(&rec)) {
          ++records;
        }
      }
      ns.push_back((thread_cpu_s() - t0) * 1e9 / static_cast<double>(records));
    }
    std::printf("read    %7.1f ns CPU per record (one thread)\n", median(ns));
    json.emplace_back("\"read_cpu_ns_per_record\"", number(median(ns)));
  }

  std::vector<Batch> held;
  if (want("input") || want("parse")) {
    std::vector<double> rate, read_ns, mix_ns, consumer_ns;
    double buffer_mb = 0;
    // Without the input phase, only the batches the parse needs.
    const int runs = want("input") ? 5 : 1;
    for (int run = 0; run < runs; ++run) {
      RecordInputOptions o;
      o.file_patterns = {dir + "/*.tfrecord"};
      o.batch_size = batch;
      if (buffer_size > 0) {
        o.buffer_size = buffer_size;
      }
      RecordInput input(o);
      RecordBatch b;
      for (int w = 0; w < 20; ++w) { // the pool fills before batches flow
        input.take(&b);
      }
      const auto before = threads_cpu();
      const double t0 = wall_s();
      int64_t examples = 0;
      while (want("input") ? wall_s() - t0 < seconds
                           : held.size() < held_batches) {
        if (input.take(&b) != torch_stage::BufferStatus::kOk) {
          break;
        }
        examples += static_cast<int64_t>(b.size());
        if (held.size() < held_batches) {
          held.push_back(Batch{b.data, b.offsets});
        }
      }
      const double wall = wall_s() - t0;
      auto after = threads_cpu();
      const auto per = [&](const char* k) {
        const auto it = before.find(k);
        return (after[k] - (it == before.end() ? 0.0 : it->second)) * 1e9 /
            static_cast<double>(examples);
      };
      rate.push_back(static_cast<double>(examples) / wall);
      buffer_mb = static_cast<double>(input.stats().buffer_bytes) / 1e6;
      read_ns.push_back(per("read"));
      mix_ns.push_back(per("shuffle"));
      consumer_ns.push_back(per("consumer"));
    }
    if (want("input")) {
      std::printf(
          "input   %9.0f examples/s; CPU ns per example: read %.0f, shuffle "
          "%.0f, consumer %.0f; pool holds %.1f MB of blocks\n",
          median(rate),
          median(read_ns),
          median(mix_ns),
          median(consumer_ns),
          buffer_mb);
      json.emplace_back("\"input_examples_per_s\"", number(median(rate)));
      json.emplace_back(
          "\"input_cpu_ns_per_example\"",
          "{\"read\": " + number(median(read_ns)) +
              ", \"shuffle\": " + number(median(mix_ns)) +
              ", \"consumer\": " + number(median(consumer_ns)) + "}");
      json.emplace_back("\"input_buffer_mb\"", number(buffer_mb));
    }
  }

  if (want("parse")) {
    std::vector<double> ns;
    size_t examples_per_pass = 0;
    for (const auto& b : held) {
      examples_per_pass += b.offsets.size() - 1;
    }
    for (int run = 0; run < 5; ++run) {
      const double t0 = thread_cpu_s();
      size_t examples = 0;
      for (int64_t pass = 0;
           reps > 0 ? pass < reps : thread_cpu_s() - t0 < seconds;
           ++pass) {
        for (const auto& b : held) {
          parse_batch(b, specs);
        }
        examples += examples_per_pass;
      }
      ns.push_back((thread_cpu_s() - t0) * 1e9 / static_cast<double>(examples));
      if (verbose) {
        std::fprintf(stderr, "%.0f ", ns.back());
      }
    }
    std::printf(
        "parse   %7.1f ns CPU per example (one thread): %.2fM examples per "
        "CPU-second\n",
        median(ns),
        1e3 / median(ns));
    json.emplace_back("\"parse_cpu_ns_per_example\"", number(median(ns)));
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{";
    for (size_t i = 0; i < json.size(); ++i) {
      out << (i == 0 ? "" : ", ") << json[i].first << ": " << json[i].second;
    }
    out << "}\n";
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
  }
  return 0;
}
