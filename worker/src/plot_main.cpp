// fsdp-plot: the curves of a training run from its metrics file (the Trainer's JSONL).
//   fsdp-plot metrics.jsonl out.png     (or out.svg)
// Panels: training loss per logged step with the evaluations' loss; evaluation accuracy (when
// the run measured it); throughput (samples/s, and tokens/s for language models).
//
// Drawn by gnuplot (Debian's gnuplot-nox): a small, scriptable plotting program with PNG
// (cairo) and SVG output and no Python stack behind it, run as a child process fed a script on
// its stdin. Exit codes: 0 success, 1 gnuplot failed, 2 bad usage or an unreadable metrics file.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "fsdp/common/error.hpp"
#include "fsdp/common/process.hpp"

namespace {

struct Series {
  std::vector<std::pair<double, double>> points;
  std::string data() const {
    std::ostringstream out;
    for (const auto& [x, y] : points) out << x << ' ' << y << '\n';
    out << "e\n";
    return out.str();
  }
};

int plot(const std::string& input, const std::string& output) {
  std::ifstream in(input);
  if (!in) throw fsdp::ConfigError("metrics file '" + input + "': cannot read it");
  Series trainLoss, evalLoss, accuracy, samples, tokens;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      throw fsdp::ConfigError("metrics file '" + input + "', line " + std::to_string(number) + ": not a JSON object");
    }
    const double step = j.value("step", 0.0);
    const std::string type = j.value("type", std::string());
    if (type == "train") {
      if (j.contains("loss")) trainLoss.points.emplace_back(step, j["loss"].get<double>());
      if (j.contains("samples_per_s")) samples.points.emplace_back(step, j["samples_per_s"].get<double>());
      if (j.contains("tokens_per_s")) tokens.points.emplace_back(step, j["tokens_per_s"].get<double>());
    } else if (type == "eval") {
      if (j.contains("loss")) evalLoss.points.emplace_back(step, j["loss"].get<double>());
      if (j.contains("accuracy")) accuracy.points.emplace_back(step, j["accuracy"].get<double>());
    }
  }
  if (trainLoss.points.empty() && evalLoss.points.empty()) {
    throw fsdp::ConfigError("metrics file '" + input + "': no train or eval lines to plot");
  }
  const std::string ext = std::filesystem::path(output).extension().string();
  std::string terminal;
  if (ext == ".png") {
    terminal = "pngcairo size 900,900 font 'sans,10'";
  } else if (ext == ".svg") {
    terminal = "svg size 900,900 font 'sans,10' background rgb 'white'";
  } else {
    throw fsdp::ConfigError("output '" + output + "': expected a .png or .svg file name");
  }
  const bool haveAccuracy = !accuracy.points.empty();
  // One step axis for every panel (a single evaluation would otherwise leave an empty range).
  double xmin = 1e300, xmax = -1e300;
  for (const Series* series : {&trainLoss, &evalLoss, &accuracy, &samples, &tokens}) {
    for (const auto& [x, y] : series->points) {
      xmin = std::min(xmin, x);
      xmax = std::max(xmax, x);
    }
  }
  xmin = std::min(xmin, 0.0);
  if (xmax <= xmin) {
    xmin -= 1;
    xmax += 1;
  }
  const int panels = 2 + (haveAccuracy ? 1 : 0);
  std::ostringstream script;
  script << "set terminal " << terminal << "\n"
         << "set output '" << output << "'\n"
         << "set multiplot layout " << panels << ",1 title '" << std::filesystem::path(input).filename().string()
         << "'\nset grid\nset key top right\nset xlabel 'step'\nset xrange [" << xmin << ":" << xmax << "]\n";
  // Loss.
  script << "set ylabel 'loss'\nplot ";
  std::string data;
  bool first = true;
  if (!trainLoss.points.empty()) {
    script << "'-' using 1:2 with lines lw 2 title 'train'";
    data += trainLoss.data();
    first = false;
  }
  if (!evalLoss.points.empty()) {
    script << (first ? "" : ", ") << "'-' using 1:2 with linespoints pt 7 ps 1.2 title 'eval'";
    data += evalLoss.data();
  }
  script << "\n" << data;
  if (haveAccuracy) {
    script << "set ylabel 'accuracy'\nset yrange [0:1]\nplot '-' using 1:2 with linespoints pt 7 title 'eval accuracy'\n"
           << accuracy.data() << "set autoscale y\n";
  }
  // Throughput (tokens on their own axis: they are blocks of samples).
  if (!tokens.points.empty()) script << "set y2tics\nset y2label 'tokens per second'\n";
  script << "set ylabel 'samples per second'\nplot ";
  data.clear();
  first = true;
  if (!samples.points.empty()) {
    script << "'-' using 1:2 with lines lw 2 title 'samples/s'";
    data += samples.data();
    first = false;
  }
  if (!tokens.points.empty()) {
    script << (first ? "" : ", ") << "'-' using 1:2 with lines lw 2 axes x1y2 title 'tokens/s'";
    data += tokens.data();
    first = false;
  }
  if (first) script << "0 notitle";
  script << "\n" << data << "unset multiplot\n";

  std::error_code ec;
  std::filesystem::remove(output, ec);  // what exists afterwards is this run's
  // gnuplot reads the script on its stdin.
  std::string why;
  if (!fsdp::findExecutable("gnuplot", &why)) {
    throw fsdp::Error("gnuplot: " + why + " (apt-get install gnuplot-nox; scripts/install-deps does it)");
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) fsdp::throwErrno("pipe2", errno);
  fsdp::SpawnOptions options{.argv = {"gnuplot"}, .env = fsdp::currentEnvironment(), .newProcessGroup = false};
  options.stdinFd = fds[0];
  auto child = fsdp::ChildProcess::spawn(options);
  ::close(fds[0]);
  const std::string text = script.str();
  std::size_t sent = 0;
  while (sent < text.size()) {
    const ssize_t n = ::write(fds[1], text.data() + sent, text.size() - sent);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    sent += static_cast<std::size_t>(n);
  }
  ::close(fds[1]);
  const auto status = child.waitFor(std::chrono::seconds(60));
  if (!status || *status != 0 || !std::filesystem::exists(output)) {
    std::cerr << "fsdp-plot: error: gnuplot failed (" << (status ? fsdp::describeWaitStatus(*status) : "timed out")
              << ") drawing " << output << "\n";
    return 1;
  }
  std::cout << "wrote " << output << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << "usage: fsdp-plot METRICS.jsonl OUT.png|OUT.svg\n";
    return 0;
  }
  if (argc != 3) {
    std::cerr << "fsdp-plot: error: usage: fsdp-plot METRICS.jsonl OUT.png|OUT.svg\n";
    return 2;
  }
  try {
    return plot(argv[1], argv[2]);
  } catch (const fsdp::ConfigError& e) {
    std::cerr << "fsdp-plot: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-plot: error: " << e.what() << "\n";
    return 1;
  }
}
