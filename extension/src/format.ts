// Small text and SVG helpers shared by the sidebar and the status bar.

export function bytes(n: number | null | undefined): string {
  if (n === null || n === undefined) {
    return '–';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function seconds(s: number | null | undefined): string {
  if (s === null || s === undefined) {
    return '–';
  }
  if (s < 60) {
    return `${s.toFixed(0)} s`;
  }
  const m = Math.floor(s / 60);
  return m < 60 ? `${m} min ${Math.round(s % 60)} s` : `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function el(
  tag: string,
  attrs: Record<string, string> = {},
  children: (Node | string)[] = []
): HTMLElement {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

/** A vertical mark on a sparkline at one step, with its tooltip. */
export interface Mark {
  step: number;
  title: string;
}

/** A loss sparkline: an SVG polyline scaled to its own range, and a vertical line at each
 * mark that falls on it (one at most a point's spacing before the first point is widened in:
 * a resumed call's curve starts just after its layout change). */
export function sparkline(points: [number, number][], marks: Mark[] = [], width = 180, height = 32): SVGElement {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('class', 'axon-nb-spark');
  if (points.length < 2) {
    return svg;
  }
  const xs = points.map(p => p[0]);
  const ys = points.map(p => p[1]);
  const spacing = (xs[xs.length - 1] - xs[0]) / (xs.length - 1);
  const shown = marks.filter(m => m.step >= xs[0] - spacing && m.step <= xs[xs.length - 1]);
  const [x0, x1] = [Math.min(...xs, ...shown.map(m => m.step)), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const fx = (x: number) => (x1 > x0 ? ((x - x0) / (x1 - x0)) * (width - 2) + 1 : 1);
  const fy = (y: number) => (y1 > y0 ? height - 1 - ((y - y0) / (y1 - y0)) * (height - 2) : height / 2);
  const line = document.createElementNS(ns, 'polyline');
  line.setAttribute('points', points.map(([x, y]) => `${fx(x).toFixed(1)},${fy(y).toFixed(1)}`).join(' '));
  svg.append(line);
  for (const m of shown) {
    const mark = document.createElementNS(ns, 'line');
    const x = fx(m.step).toFixed(1);
    for (const [k, v] of Object.entries({ x1: x, x2: x, y1: '0', y2: String(height), class: 'axon-nb-spark-mark' })) {
      mark.setAttribute(k, v);
    }
    const title = document.createElementNS(ns, 'title');
    title.textContent = m.title;
    mark.append(title);
    svg.append(mark);
  }
  return svg;
}
