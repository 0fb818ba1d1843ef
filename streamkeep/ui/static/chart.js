// A small line chart drawn as SVG by hand: a few series over the last `points` samples, each
// scaled to its own maximum (appends/s and live readers have nothing in common but time), with
// the latest values in the legend.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 360;
const HEIGHT = 90;

export function makeChart(parent, series, points = 40) {
  const history = series.map(() => []);
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute("class", "chart");
  svg.setAttribute("preserveAspectRatio", "none"); // stretched to its box; strokes keep their width
  svg.setAttribute("role", "img");
  const grid = document.createElementNS(SVG, "path");
  grid.setAttribute("d", `M0 ${HEIGHT - 0.5}H${WIDTH}M0 ${HEIGHT / 2}H${WIDTH}`);
  grid.setAttribute("class", "grid");
  svg.append(grid);
  const lines = series.map((item, i) => {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("class", `series series-${i}`);
    svg.append(line);
    return line;
  });
  const legend = document.createElement("div");
  legend.className = "legend";
  const values = series.map((item, i) => {
    const value = document.createElement("span");
    value.className = `series-${i}`;
    legend.append(value);
    return value;
  });
  parent.append(svg, legend);

  function draw() {
    history.forEach((samples, i) => {
      const peak = Math.max(0, ...samples);
      const top = Math.max(1, peak);
      const step = WIDTH / (points - 1);
      const offset = points - samples.length;
      lines[i].setAttribute("points", samples.map((v, k) =>
        `${((offset + k) * step).toFixed(1)},${(HEIGHT - 2 - (v / top) * (HEIGHT - 6)).toFixed(1)}`).join(" "));
      const last = samples.at(-1);
      values[i].textContent = `${series[i].label}: ${last === undefined ? "-" : series[i].format(last)}` +
        ` (peak ${series[i].format(peak)})`;
    });
    svg.setAttribute("aria-label", values.map((v) => v.textContent).join("; "));
  }

  draw();
  return {
    push(sample) {
      sample.forEach((value, i) => {
        history[i].push(value);
        if (history[i].length > points) history[i].shift();
      });
      draw();
    },
  };
}
